/* expost dashboard: plain JS, no build step. Talks only to this server's JSON API with the pasted key.
 *
 * Every ~2 s it polls the dataset's budget with If-None-Match (re-rendering only on 200, keeping the
 * picture on 304), then fetches what is new in the ledger and the refusals (cursor pagination) and what
 * is in flight. For an analyst it also polls their own sub-budget and shows whichever of the two binds.
 * Everything shown comes from the API and is inserted as text, never as HTML.
 */
"use strict";

(() => {
  const POLL_MS = 2000;
  const PAGE_SIZE = 25;
  const DATASETS_EVERY = 15; // polls between two reads of the dataset list (archive marks): ~30 s
  const FETCH_PAGE = 1000;
  const UNITS_PER_EPSILON = 1e12;
  const KEY_STORAGE = "expost.apiKey";
  const DATASET_STORAGE = "expost.datasetId"; // localStorage: the dataset last used, kept across logins
  const COLORS = {
    capacity: "#6b7687",
    spent: "#d23c3c",
    reserved: "#e79a16",
    remaining: "#1f9d55",
    binding: "#2457c5",
  };

  const TICKS = new Set([1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000]);
  const $ = (id) => document.getElementById(id);

  const state = {
    key: null,
    datasets: [],
    datasetId: null,
    generation: 0,
    timer: null,
    etag: null,
    budget: null,
    // Who the key is (GET /v1/me, read once per login): analyst = true / false / null (not read yet).
    me: { analyst: null, name: null, searched: false },
    ownEtag: null,
    own: null,
    ledger: [],
    ledgerAfter: 0,
    ledgerPage: 0,
    refusals: [],
    refusalsAfter: 0,
    activity: null,
    polls: 0,
    renders: 0,
    charts: {},
  };

  class AuthError extends Error {}
  class Stale extends Error {}

  class ApiProblem extends Error {
    constructor(status, body) {
      super((body && (body.detail || body.title)) || `HTTP ${status}`);
      this.status = status;
      this.body = body;
    }
  }

  // ----- helpers ---------------------------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === null || value === undefined) continue;
      if (name === "class") node.className = value;
      else if (name === "title") node.title = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  /** A loss in ε units for display: numbers, "inf" → ∞, null → —. */
  function fmt(value, digits = 4) {
    if (value === null || value === undefined || value === "") return "—";
    if (value === "inf" || value === Infinity) return "∞";
    if (typeof value !== "number" || Number.isNaN(value)) return String(value);
    if (value === 0) return "0";
    const magnitude = Math.abs(value);
    if (magnitude >= 1e-3 && magnitude < 1e6) return String(Number(value.toPrecision(digits)));
    return Number(value.toPrecision(digits)).toExponential();
  }

  function fmtAlpha(alpha) {
    if (alpha === null || alpha === undefined) return "—";
    if (alpha === "delta") return "δ share";  // an approximate-DP refusal whose ε fits
    return alpha === "pure" ? "∞ (pure)" : fmt(alpha, 6);
  }

  /** A chartable number: "inf" and null become null (a gap). */
  function num(value) {
    return typeof value === "number" && Number.isFinite(value) ? value : null;
  }

  function time(iso) {
    if (!iso) return "—";
    const date = new Date(iso);
    return Number.isNaN(date.getTime()) ? String(iso) : date.toLocaleTimeString();
  }

  function dateTime(iso) {
    const date = new Date(iso);
    return Number.isNaN(date.getTime()) ? String(iso) : date.toLocaleString();
  }

  function relative(iso) {
    const ms = Date.parse(iso);
    if (Number.isNaN(ms)) return "—";
    const seconds = Math.round((ms - Date.now()) / 1000);
    const abs = Math.abs(seconds);
    const text = abs < 90 ? `${abs} s` : abs < 5400 ? `${Math.round(abs / 60)} min` : `${Math.round(abs / 3600)} h`;
    return seconds >= 0 ? `in ${text}` : `${text} ago`;
  }

  function setValue(id, value, text) {
    const node = $(id);
    node.textContent = text === undefined ? fmt(value) : text;
    node.dataset.value = value === null || value === undefined ? "" : String(value);
  }

  function setStatus(text, bad = false) {
    const node = $("status");
    node.textContent = text;
    node.classList.toggle("bad", bad);
    node.dataset.polls = String(state.polls);
    node.dataset.renders = String(state.renders);
  }

  function fillTable(body, rows, columns, emptyText) {
    const tbody = $(body);
    tbody.replaceChildren();
    if (rows.length === 0) {
      tbody.append(el("tr", { class: "empty" }, el("td", { colspan: String(columns) }, emptyText)));
      return;
    }
    for (const cells of rows) tbody.append(el("tr", null, ...cells));
  }

  // ----- API -----------------------------------------------------------------------------------------

  async function api(path, extraHeaders) {
    const headers = { Accept: "application/json", Authorization: `Bearer ${state.key}`, ...(extraHeaders || {}) };
    // no-store: the browser's cache never answers for us, so a 304 reaches this code as a 304.
    const response = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
    if (response.status === 401) throw new AuthError("the API key was refused (unknown or revoked)");
    return response;
  }

  async function getJson(path) {
    const response = await api(path);
    if (!response.ok) {
      let body = null;
      try {
        body = await response.json();
      } catch (_) {
        body = null;
      }
      throw new ApiProblem(response.status, body);
    }
    return response.json();
  }

  function datasetPath(suffix) {
    return `/v1/datasets/${encodeURIComponent(state.datasetId)}/${suffix}`;
  }

  function checkFresh(generation) {
    if (generation !== state.generation) throw new Stale();
  }

  // ----- login -----------------------------------------------------------------------------------------

  async function login(key) {
    state.key = key;
    const datasets = await getJson("/v1/datasets");
    sessionStorage.setItem(KEY_STORAGE, key);
    $("login").hidden = true;
    $("app").hidden = false;
    $("session-bar").hidden = false;
    $("key-hint").textContent = `${key.slice(0, 10)}…`;
    showDatasets(datasets);
  }

  function logout(message) {
    stopPolling();
    state.generation += 1;
    state.key = null;
    state.me = { analyst: null, name: null, searched: false };
    sessionStorage.removeItem(KEY_STORAGE);
    for (const chart of Object.values(state.charts)) chart.destroy();
    state.charts = {};
    $("app").hidden = true;
    $("session-bar").hidden = true;
    $("login").hidden = false;
    $("api-key").value = "";
    $("login-error").textContent = message || "";
    $("api-key").focus();
  }

  function protects(dataset) {
    // who ε protects: each privacy unit with all its rows (and the bound in force), or each row
    const unit = dataset && dataset.schema ? dataset.schema.privacy_unit : null;
    if (!dataset) return "—";
    if (!unit) return "each row";
    return `each ${unit.column} with all its rows (at most ${unit.max_rows} per release)`;
  }

  function showDatasets(datasets) {
    state.datasets = datasets;
    const select = $("dataset-select");
    select.replaceChildren();
    $("no-datasets").hidden = datasets.length > 0;
    $("panels").hidden = datasets.length === 0;
    if (datasets.length === 0) {
      select.append(el("option", { value: "" }, "no datasets"));
      stopPolling();
      return;
    }
    for (const d of datasets) {
      select.append(el("option", { value: d.id, "data-archived-at": d.archived_at || null }, datasetLabel(d)));
    }
    // The dataset in the URL's #fragment, else the one last used in this browser, else the first one.
    const wanted = [location.hash.slice(1), storedDataset()];
    const chosen = wanted.find((id) => id && datasets.some((d) => d.id === id)) || datasets[0].id;
    select.value = chosen;
    selectDataset(chosen);
  }

  /** A dataset in the selector: its name and id, and "archived" with the day (UTC) once archived. */
  function datasetLabel(dataset) {
    const archived = dataset.archived_at ? ` · archived ${String(dataset.archived_at).slice(0, 10)}` : "";
    return `${dataset.name} (${dataset.id})${archived}`;
  }

  /** The archive mark of the dataset on show: a badge by its name and a banner above the panels. */
  function renderArchived() {
    const dataset = state.datasets.find((d) => d.id === state.datasetId);
    const at = dataset && dataset.archived_at ? String(dataset.archived_at) : "";
    const banner = $("archived-banner");
    banner.hidden = !at;
    banner.dataset.archivedAt = at;
    banner.textContent = at
      ? `Archived on ${dateTime(at)}: no new requests or sessions are admitted. Its history, budget and ` +
        "ledger stay readable; nothing was deleted."
      : "";
    $("archived-badge").hidden = !at;
    $("archived-badge").title = at ? `archived on ${dateTime(at)}` : "";
  }

  /** Re-read the dataset list now and then (an admin may archive a dataset while the page is open):
   * the selector's labels and the archive mark follow; the choice of dataset is kept. */
  async function refreshDatasets(generation) {
    if (state.polls === 0 || state.polls % DATASETS_EVERY !== 0) return; // login has just read it
    const fresh = await getJson("/v1/datasets");
    checkFresh(generation);
    const byId = new Map(fresh.map((d) => [d.id, d]));
    state.datasets = state.datasets.map((d) => byId.get(d.id) || d);
    for (const option of $("dataset-select").options) {
      const dataset = byId.get(option.value);
      if (!dataset) continue;
      option.textContent = datasetLabel(dataset);
      if (dataset.archived_at) option.dataset.archivedAt = dataset.archived_at;
    }
    renderArchived();
  }

  function storedDataset() {
    try {
      return localStorage.getItem(DATASET_STORAGE);
    } catch (_) {
      return null; // storage disabled: fall back to the first dataset
    }
  }

  function storeDataset(id) {
    try {
      localStorage.setItem(DATASET_STORAGE, id);
    } catch (_) {
      // storage disabled or full: the choice is simply not remembered
    }
  }

  // ----- dataset selection and polling ------------------------------------------------------------

  function stopPolling() {
    if (state.timer !== null) clearTimeout(state.timer);
    state.timer = null;
  }

  function selectDataset(id) {
    stopPolling();
    state.generation += 1;
    Object.assign(state, {
      datasetId: id,
      etag: null,
      budget: null,
      ownEtag: null,
      own: null,
      ledger: [],
      ledgerAfter: 0,
      ledgerPage: 0,
      refusals: [],
      refusalsAfter: 0,
      activity: null,
    });
    storeDataset(id);
    const dataset = state.datasets.find((d) => d.id === id);
    $("dataset-name").textContent = dataset ? `· ${dataset.name}` : "";
    $("privacy-unit").textContent = protects(dataset);
    // Individual accounting: each unit has its own budget; the totals below are a public record, not a budget.
    const individual = Boolean(dataset && dataset.accounting === "individual");
    $("accounting-badge").hidden = !individual;
    $("accounting-badge").title = individual ? dataset.accounting_meaning || "" : "";
    renderArchived();
    for (const id of ["eps-spent", "eps-remaining", "binding-alpha", "pure-capacity", "pure-spent", "pure-reserved", "pure-remaining"]) {
      setValue(id, null);
    }
    $("target").textContent = "—";
    $("own-budget").hidden = true;
    $("own-note").textContent = "";
    $("remaining-source").textContent = "";
    $("eps-remaining").dataset.filter = "";
    $("budget-note").textContent = "";
    $("spend-note").textContent = "";
    for (const body of ["orders-body", "requests-body", "sessions-body"]) $(body).replaceChildren();
    $("ledger-event").replaceChildren(el("option", { value: "" }, "all"));
    $("ledger-actor").replaceChildren(el("option", { value: "" }, "all"));
    renderLedger();
    renderRefusals();
    poll();
  }

  async function poll() {
    const generation = state.generation;
    state.timer = null;
    if (!state.key || !state.datasetId) return;
    try {
      if (!document.hidden || state.budget === null) {
        const changed = await pollBudget(generation);
        const newEntries = await pollLedger(generation);
        const newRefusals = await pollRefusals(generation);
        await pollActivity(generation);
        const ownChanged = await pollOwn(generation);
        await refreshDatasets(generation);
        state.polls += 1;
        if (newEntries || (changed && state.ledger.length)) renderSpend();
        if (newEntries) renderLedger();
        if (newRefusals) renderRefusals();
        const what = changed || ownChanged ? "budget changed" : "budget unchanged (304)";
        setStatus(`Updated ${new Date().toLocaleTimeString()} · ${what} · polling every ${POLL_MS / 1000} s`);
      }
    } catch (error) {
      if (error instanceof Stale) return;
      if (error instanceof AuthError) {
        logout(`Logged out: ${error.message}.`);
        return;
      }
      const text = error instanceof ApiProblem ? `${error.status}: ${error.message}` : `server unreachable (${error.message})`;
      setStatus(`Could not refresh: ${text}; retrying…`, true);
    }
    if (generation === state.generation && state.key) state.timer = setTimeout(poll, POLL_MS);
  }

  /** GET a budget view with If-None-Match; null when unchanged (304). */
  async function fetchBudget(path, etag, generation) {
    const response = await api(path, etag ? { "If-None-Match": etag } : {});
    checkFresh(generation);
    if (response.status === 304) return null;
    if (!response.ok) {
      let body = null;
      try {
        body = await response.json();
      } catch (_) {
        body = null;
      }
      throw new ApiProblem(response.status, body);
    }
    const budget = await response.json();
    checkFresh(generation);
    return { budget, etag: response.headers.get("ETag") };
  }

  async function pollBudget(generation) {
    const fresh = await fetchBudget(datasetPath("budget"), state.etag, generation);
    if (fresh === null) return false;
    state.etag = fresh.etag;
    state.budget = fresh.budget;
    renderBudget();
    return true;
  }

  /** Who the key is (GET /v1/me), once per login: whether it is an analyst's, and its name. */
  async function identify(generation) {
    const me = state.me;
    if (me.searched) return;
    const who = await getJson("/v1/me");
    checkFresh(generation);
    me.searched = true;
    me.analyst = who.role === "analyst";
    me.name = who.name;
  }

  /** An analyst's own sub-budget on this dataset; true when it changed. */
  async function pollOwn(generation) {
    await identify(generation);
    const me = state.me;
    if (!me.analyst) return false;
    if (!me.name) {
      renderConstraint();
      return false;
    }
    const path = datasetPath(`analysts/${encodeURIComponent(me.name)}/budget`);
    const fresh = await fetchBudget(path, state.ownEtag, generation);
    if (fresh === null) return false;
    state.ownEtag = fresh.etag;
    state.own = fresh.budget;
    renderConstraint();
    return true;
  }

  async function pollLedger(generation) {
    let added = false;
    for (;;) {
      const page = await getJson(`${datasetPath("ledger")}?after=${state.ledgerAfter}&limit=${FETCH_PAGE}`);
      checkFresh(generation);
      if (page.items.length) {
        state.ledger.push(...page.items);
        state.ledgerAfter = page.items[page.items.length - 1].seq;
        added = true;
      }
      if (page.next_after === null || page.items.length === 0) return added;
    }
  }

  async function pollRefusals(generation) {
    let added = false;
    for (;;) {
      const page = await getJson(`${datasetPath("refusals")}?after=${state.refusalsAfter}&limit=${FETCH_PAGE}`);
      checkFresh(generation);
      if (page.items.length) {
        state.refusals.push(...page.items);
        state.refusalsAfter = page.items[page.items.length - 1].id;
        added = true;
      }
      if (page.next_after === null || page.items.length === 0) return added;
    }
  }

  async function pollActivity(generation) {
    const activity = await getJson(datasetPath("activity"));
    checkFresh(generation);
    state.activity = activity;
    renderActivity();
  }

  // ----- budget: numbers and the Rényi curve ------------------------------------------------------

  function renderBudget() {
    const b = state.budget;
    state.renders += 1;
    const target = b.budget_set ? `ε = ${fmt(b.epsilon)}, δ = ${fmt(b.delta)}` : "not set";
    $("target").textContent = target;
    $("delta-label").textContent = b.budget_set ? `(at δ = ${fmt(b.delta)})` : "";
    setValue("eps-spent", b.epsilon_spent);
    renderConstraint();
    // The δ-ledger of approximate-DP mechanisms (docs/privacy/approximate.md#approximate-dp): shown only when a share is set.
    const hasShare = b.delta_share !== null && b.delta_share !== undefined;
    $("delta-ledger").hidden = !hasShare;
    if (hasShare) {
      const used = (num(b.delta_spent) ?? 0) + (num(b.delta_reserved) ?? 0);
      setValue("delta-used", used, `${fmt(used)} of ${fmt(b.delta_share)}`);
    }

    const pure = b.pure;
    setValue("pure-capacity", pure.capacity);
    setValue("pure-spent", pure.spent);
    setValue("pure-reserved", pure.reserved);
    setValue("pure-remaining", pure.remaining);
    const meter = $("pure-meter");
    const capacity = num(pure.capacity);
    meter.classList.toggle("unusable", !capacity);
    const share = (v) => (capacity ? `${Math.min(100, (100 * (num(v) ?? capacity)) / capacity)}%` : "0%");
    $("pure-meter-spent").style.width = share(pure.spent);
    $("pure-meter-reserved").style.width = share(pure.reserved);
    $("pure-slot").classList.toggle("binding", b.binding_alpha === "pure");

    const usable = b.orders.filter((row) => row.capacity !== null).length;
    let note = "";
    if (!b.budget_set) note = "No budget is set on this dataset yet: an admin must PUT one.";
    else if (b.binding === false) note = individualNote();
    else if (usable === 0) note = "δ = 0: a pure filter. Only the pure slot (α = ∞) has capacity.";
    else if (b.epsilon_remaining === 0) note = "Exhausted: no slot can admit any further request.";
    $("budget-note").textContent = note;

    fillTable(
      "orders-body",
      [...b.orders, b.pure].map((row) => [
        el("td", null, fmtAlpha(row.alpha)),
        el("td", null, fmt(row.capacity)),
        el("td", null, fmt(row.spent)),
        el("td", null, fmt(row.reserved)),
        el("td", null, fmt(row.remaining)),
      ]),
      5,
      "no orders",
    );
    renderCurve();
    const canvas = $("curve-chart");
    canvas.dataset.renders = String(state.renders);
  }

  /** Under individual accounting the dataset's totals are a public record of worst cases, not a budget. */
  function individualNote() {
    const dataset = state.datasets.find((d) => d.id === state.datasetId);
    const unit = dataset && dataset.schema && dataset.schema.privacy_unit;
    const who = unit ? `each ${unit.column}` : "each unit";
    return (
      `Individual accounting: ${who} has its own budget (the target above) and releases leave out the ` +
      "units that cannot afford them; these totals are a public record of worst cases, not a budget."
    );
  }

  /** A filter's remaining ε for comparison: no budget or no usable slot admits nothing; a filter that is
   * not binding (the dataset's, under individual accounting) limits nothing. */
  function remainingOf(view) {
    if (view.binding === false) return Infinity;
    return view.budget_set ? num(view.epsilon_remaining) ?? 0 : 0;
  }

  /**
   * ε remaining and the binding order: the dataset's, or for an analyst with a sub-budget the smaller of
   * the two (a request must fit both filters), saying which one binds; both numbers are shown.
   */
  function renderConstraint() {
    const b = state.budget;
    if (!b) return;
    const own = state.own && state.own.budget_set ? state.own : null;
    const node = $("eps-remaining");
    $("own-budget").hidden = own === null;
    let note = "";
    if (state.me.analyst && state.own && !own) {
      note = "No sub-budget of yours is set on this dataset: the dataset's budget applies.";
    }
    $("own-note").textContent = note;
    if (own === null) {
      setValue("eps-remaining", b.epsilon_remaining);
      setValue("binding-alpha", b.binding_alpha, fmtAlpha(b.binding_alpha));
      node.dataset.filter = "dataset";
      $("remaining-source").textContent = b.binding === false ? "(public record, not a budget)" : "";
      return;
    }
    const mine = remainingOf(own);
    const theirs = remainingOf(b);
    const filter = mine < theirs ? "analyst" : mine > theirs ? "dataset" : "both";
    const binding = filter === "dataset" ? b : own;
    setValue("eps-remaining", binding.epsilon_remaining);
    setValue("binding-alpha", binding.binding_alpha, fmtAlpha(binding.binding_alpha));
    node.dataset.filter = filter;
    $("remaining-source").textContent = {
      analyst: "(binding: your sub-budget)",
      dataset: "(binding: dataset)",
      both: "(binding: your sub-budget and the dataset)",
    }[filter];
    $("own-target").textContent = `ε = ${fmt(own.epsilon)}, δ = ${fmt(own.delta)}`;
    setValue("own-spent", own.epsilon_spent);
    setValue("own-remaining", own.epsilon_remaining);
    setValue("dataset-remaining", b.epsilon_remaining);
    $("own-budget").classList.toggle("binding", filter !== "dataset");
  }

  /** Draws a dashed vertical line at the binding order (a tiny inline Chart.js plugin). */
  const bindingLine = {
    id: "bindingLine",
    afterDatasetsDraw(chart, _args, options) {
      const alpha = options.alpha;
      if (typeof alpha !== "number") return;
      const x = chart.scales.x.getPixelForValue(alpha);
      const { top, bottom } = chart.chartArea;
      const ctx = chart.ctx;
      ctx.save();
      ctx.strokeStyle = COLORS.binding;
      ctx.lineWidth = 1.5;
      ctx.setLineDash([5, 4]);
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, bottom);
      ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = COLORS.binding;
      ctx.font = "600 12px system-ui, sans-serif";
      const label = `binding α = ${fmt(alpha, 6)}`;
      const width = ctx.measureText(label).width;
      ctx.fillText(label, Math.min(x + 6, chart.chartArea.right - width - 2), top + 14);
      ctx.restore();
    },
  };

  function renderCurve() {
    const b = state.budget;
    const rows = b.orders;
    const binding = typeof b.binding_alpha === "number" ? b.binding_alpha : null;
    const series = (key) => rows.map((row) => ({ x: row.alpha, y: num(row[key]) }));
    const capacities = rows.map((row) => num(row.capacity)).filter((v) => v !== null);
    const capMax = capacities.length ? Math.max(...capacities) : null;
    const highlight = (base) => rows.map((row) => (row.alpha === binding ? COLORS.binding : base));
    const radius = rows.map((row) => (row.alpha === binding ? 7 : 2.5));
    const datasets = [
      { label: "capacity", data: series("capacity"), borderColor: COLORS.capacity, borderDash: [6, 4], pointRadius: 0, borderWidth: 2 },
      { label: "spent", data: series("spent"), borderColor: COLORS.spent, backgroundColor: COLORS.spent, pointRadius: 2.5, borderWidth: 2 },
      { label: "reserved", data: series("reserved"), borderColor: COLORS.reserved, backgroundColor: COLORS.reserved, pointRadius: 2.5, borderWidth: 2 },
      {
        label: "remaining",
        data: series("remaining"),
        borderColor: COLORS.remaining,
        backgroundColor: "rgba(31, 157, 85, 0.12)",
        fill: "origin",
        pointRadius: radius,
        pointBackgroundColor: highlight(COLORS.remaining),
        pointBorderColor: highlight(COLORS.remaining),
        borderWidth: 2.5,
      },
    ];
    const chart = state.charts.curve;
    if (chart) {
      chart.data.datasets = datasets;
      chart.options.plugins.bindingLine.alpha = binding;
      chart.options.scales.y.max = capMax ? capMax * 1.15 : undefined;
      chart.update();
      return;
    }
    state.charts.curve = new Chart($("curve-chart"), {
      type: "line",
      data: { datasets },
      plugins: [bindingLine],
      options: {
        animation: false,
        maintainAspectRatio: false,
        spanGaps: false,
        parsing: false,
        interaction: { mode: "nearest", axis: "x", intersect: false },
        scales: {
          x: {
            type: "logarithmic",
            title: { display: true, text: "Rényi order α (log scale)" },
            ticks: { autoSkip: false, callback: (value) => (TICKS.has(value) ? fmt(value, 6) : "") },
          },
          y: { min: 0, max: capMax ? capMax * 1.15 : undefined, title: { display: true, text: "ε (Rényi)" } },
        },
        plugins: {
          bindingLine: { alpha: binding },
          legend: { position: "bottom" },
          tooltip: {
            callbacks: {
              title: (items) => (items.length ? `α = ${fmt(items[0].parsed.x, 6)}` : ""),
              label: (item) => `${item.dataset.label}: ${fmt(item.parsed.y)}`,
            },
          },
        },
      },
    });
  }

  // ----- spend over time -----------------------------------------------------------------------------

  function renderSpend() {
    const b = state.budget;
    if (!b) return;
    const orders = b.orders.map((row) => row.alpha);
    const pureIndex = orders.length;
    const binding = typeof b.binding_alpha === "number" ? orders.indexOf(b.binding_alpha) : -1;
    const pure = [];
    const atBinding = [];
    let pureUnits = 0;
    let pureInfinite = false;
    let bindingUnits = 0;
    let commits = 0;
    for (const entry of state.ledger) {
      const at = Date.parse(entry.at);
      if (pure.length === 0) {
        pure.push({ x: at, y: 0 });
        atBinding.push({ x: at, y: 0 });
      }
      if (entry.event !== "commit" || !entry.realized) continue;
      commits += 1;
      const { finite, infinite } = entry.realized;
      pureUnits += finite[pureIndex] || 0;
      pureInfinite = pureInfinite || (infinite[pureIndex] || 0) > 0;
      pure.push({ x: at, y: pureInfinite ? null : pureUnits / UNITS_PER_EPSILON });
      if (binding >= 0) {
        bindingUnits += finite[binding] || 0;
        atBinding.push({ x: at, y: bindingUnits / UNITS_PER_EPSILON });
      }
    }
    if (pure.length) {
      const now = Date.now();
      pure.push({ x: now, y: pure[pure.length - 1].y });
      if (binding >= 0) atBinding.push({ x: now, y: atBinding[atBinding.length - 1].y });
    }
    const datasets = [
      { label: "pure slot (α = ∞)", data: pure, borderColor: COLORS.spent, backgroundColor: COLORS.spent, stepped: true, pointRadius: 0, borderWidth: 2 },
    ];
    if (binding >= 0) {
      datasets.push({
        label: `binding order α = ${fmt(b.binding_alpha, 6)}`,
        data: atBinding,
        borderColor: COLORS.binding,
        backgroundColor: COLORS.binding,
        stepped: true,
        pointRadius: 0,
        borderWidth: 2,
      });
    }
    $("spend-note").textContent = commits
      ? `${commits} committed charge${commits === 1 ? "" : "s"} in the ledger${pureInfinite ? "; the pure slot is ∞ after a mechanism without a pure bound" : ""}.`
      : "Nothing committed yet.";
    const chart = state.charts.spend;
    if (chart) {
      chart.data.datasets = datasets;
      chart.update();
      return;
    }
    state.charts.spend = new Chart($("spend-chart"), {
      type: "line",
      data: { datasets },
      options: {
        animation: false,
        maintainAspectRatio: false,
        parsing: false,
        interaction: { mode: "nearest", axis: "x", intersect: false },
        scales: {
          x: { type: "linear", title: { display: true, text: "time" }, ticks: { maxTicksLimit: 6, callback: (value) => new Date(value).toLocaleTimeString() } },
          y: { min: 0, title: { display: true, text: "ε spent" } },
        },
        plugins: {
          legend: { position: "bottom" },
          tooltip: {
            callbacks: {
              title: (items) => (items.length ? dateTime(items[0].parsed.x) : ""),
              label: (item) => `${item.dataset.label}: ${fmt(item.parsed.y)}`,
            },
          },
        },
      },
    });
  }

  // ----- in flight, refusals, ledger ----------------------------------------------------------------

  function renderActivity() {
    const a = state.activity;
    $("requests-count").textContent = String(a.requests.length);
    $("sessions-count").textContent = String(a.sessions.length);
    fillTable(
      "requests-body",
      a.requests.map((r) => [
        el("td", { class: "mono" }, r.id),
        el("td", null, r.analyst),
        el("td", null, r.mechanism),
        el("td", null, fmt(r.worst_case_pure)),
        el("td", null, fmt(r.worst_case_binding)),
        el("td", { title: dateTime(r.since) }, relative(r.since)),
      ]),
      6,
      "nothing running",
    );
    fillTable(
      "sessions-body",
      a.sessions.map((s) => [
        el("td", { class: "mono" }, s.id),
        el("td", null, s.analyst),
        el("td", null, s.mechanism),
        el("td", null, s.max_queries ? `${s.asked} / ${s.max_queries}` : String(s.asked)),
        el("td", null, fmt(s.worst_case_pure)),
        el("td", { title: dateTime(s.expires_at) }, relative(s.expires_at)),
      ]),
      6,
      "no open session",
    );
  }

  function renderRefusals() {
    const rows = [...state.refusals].reverse();
    $("refusals-count").textContent = String(rows.length);
    fillTable(
      "refusals-body",
      rows.slice(0, 50).map((r) => [
        el("td", { title: dateTime(r.created_at) }, time(r.created_at)),
        el("td", null, r.analyst),
        el("td", null, r.kind === "session" ? `${r.mechanism} (session)` : r.mechanism),
        el("td", null, fmt(r.requested_pure)),
        el("td", { title: r.detail }, el("span", { class: "tag refused" }, r.problem_type.replace("/problems/", ""))),
        el("td", null, r.filter),
        el("td", null, fmtAlpha(r.binding_alpha)),
        el("td", null, fmt(r.shortfall)),
      ]),
      8,
      "no refusal",
    );
  }

  function summary(entry) {
    const pureOf = (units) => {
      if (!units) return null;
      const i = units.finite.length - 1;
      return units.infinite[i] > 0 ? "inf" : units.finite[i] / UNITS_PER_EPSILON;
    };
    switch (entry.event) {
      case "budget":
        return `${entry.scope === "*" ? "dataset" : `analyst ${entry.scope}`}: ε = ${fmt(entry.epsilon)}, δ = ${fmt(entry.delta)}`;
      case "reserve":
        return `${entry.mechanism}; worst case ε (pure) ${fmt(pureOf(entry.worst_case))}`;
      case "commit":
        return `${entry.outcome || "committed"}; realized ε (pure) ${fmt(pureOf(entry.realized))}`;
      case "abort":
        return entry.reason || "aborted";
      case "grant":
        return `granted ${entry.analyst}`;
      case "dataset":
        return `created “${entry.name}”`;
      default:
        return "";
    }
  }

  function syncOptions(selectId, values) {
    const select = $(selectId);
    const present = new Set([...select.options].map((o) => o.value));
    for (const value of [...values].sort()) {
      if (!present.has(value)) select.append(el("option", { value }, value));
    }
  }

  function renderLedger() {
    syncOptions("ledger-event", new Set(state.ledger.map((e) => e.event)));
    syncOptions("ledger-actor", new Set(state.ledger.map((e) => e.actor)));
    const event = $("ledger-event").value;
    const actor = $("ledger-actor").value;
    const rows = state.ledger.filter((e) => (!event || e.event === event) && (!actor || e.actor === actor)).reverse();
    const pages = Math.max(1, Math.ceil(rows.length / PAGE_SIZE));
    state.ledgerPage = Math.min(state.ledgerPage, pages - 1);
    const start = state.ledgerPage * PAGE_SIZE;
    $("ledger-count").textContent = String(state.ledger.length);
    $("ledger-page").textContent = rows.length
      ? `${start + 1}–${Math.min(start + PAGE_SIZE, rows.length)} of ${rows.length}`
      : "0 entries";
    $("ledger-newer").disabled = state.ledgerPage === 0;
    $("ledger-older").disabled = state.ledgerPage >= pages - 1;
    fillTable(
      "ledger-body",
      rows.slice(start, start + PAGE_SIZE).map((e) => [
        el("td", null, String(e.seq)),
        el("td", { title: dateTime(e.at) }, time(e.at)),
        el("td", null, el("span", { class: `tag ${e.event}` }, e.event)),
        el("td", null, e.actor),
        el("td", { class: "mono" }, e.request_id || ""),
        el("td", { class: "wrap" }, summary(e)),
      ]),
      6,
      "no ledger entry",
    );
  }

  // ----- wiring ------------------------------------------------------------------------------------

  function start() {
    $("login-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const key = $("api-key").value.trim();
      if (!key) return;
      $("login-error").textContent = "";
      $("login-button").disabled = true;
      try {
        await login(key);
      } catch (error) {
        state.key = null;
        sessionStorage.removeItem(KEY_STORAGE);
        $("login-error").textContent =
          error instanceof AuthError ? "Unknown or revoked API key." : `Could not log in: ${error.message}`;
      } finally {
        $("login-button").disabled = false;
      }
    });
    $("logout").addEventListener("click", () => logout(""));
    $("dataset-select").addEventListener("change", (event) => {
      if (event.target.value && event.target.value !== state.datasetId) selectDataset(event.target.value);
    });
    for (const id of ["ledger-event", "ledger-actor"]) {
      $(id).addEventListener("change", () => {
        state.ledgerPage = 0;
        renderLedger();
      });
    }
    $("ledger-newer").addEventListener("click", () => {
      state.ledgerPage = Math.max(0, state.ledgerPage - 1);
      renderLedger();
    });
    $("ledger-older").addEventListener("click", () => {
      state.ledgerPage += 1;
      renderLedger();
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && state.key && state.timer !== null) {
        stopPolling();
        poll();
      }
    });

    const saved = sessionStorage.getItem(KEY_STORAGE);
    if (saved) {
      login(saved).catch((error) => logout(error instanceof AuthError ? "Logged out: the saved key was refused." : `Could not log in: ${error.message}`));
    } else {
      logout("");
    }
  }

  if (typeof Chart === "undefined") {
    document.addEventListener("DOMContentLoaded", () => {
      $("login").hidden = false;
      $("login-error").textContent = "The chart library did not load; reload the page.";
    });
    return;
  }
  Chart.defaults.font.family = getComputedStyle(document.documentElement).fontFamily;
  Chart.defaults.color = "#5f6b7a";
  start();
})();
