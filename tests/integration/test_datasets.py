"""Datasets over real HTTP: each dataset's declared bounds clip its own table, and what the API shows about a
dataset (its content hash, its row count) reveals no row to an analyst or a viewer."""

from __future__ import annotations

import hashlib
import secrets

from tests.conftest import LiveServer
from tests.integration.helpers import BIG, SCHEMA, add_dataset, expect, ledger_items, make_world


class TestDeclaredBounds:
    """A table is clipped to the bounds of the dataset that loads it."""

    def test_datasets_sharing_a_file_but_not_bounds_share_one_clipped_table(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, BIG)
        rows = [100 + secrets.randbelow(900) for _ in range(50)]  # random: a file no other test loaded
        csv = b"x\n" + b"".join(f"{v}\n".encode() for v in rows)
        wide, narrow = (
            {"columns": [{"name": "x", "type": "float", "min": 0, "max": high}], "neighboring": "replace_one"}
            for high in (1e6, 1)
        )
        wide_id, narrow_id = add_dataset(world, csv, wide, BIG), add_dataset(world, csv, narrow, BIG)
        query = {"query": {"kind": "sum", "column": "x"}, "epsilon": 100.0}
        assert world.request(world.analyst, query, dataset_id=wide_id).status_code == 200  # loads the cache
        released = world.request(world.analyst, query, dataset_id=narrow_id)
        assert released.status_code == 200, released.text
        assert released.json()["release"]["noise"]["scale"] < 0.011  # calibrated to Δ = max − min = 1
        # Every value is clipped to [0, 1] on the narrow dataset, so its true sum is at most 50.
        value = released.json()["release"]["value"]
        expect(value <= 50 + 5, f"released {value} with scale 0.01; the unclipped sum is {sum(rows)}")


class TestMetadataRevealsNoRow:
    """docs/privacy/rules.md#rule-public-charges: what is shown of a dataset is public information only."""

    def test_an_analyst_recovers_a_hidden_row_from_the_content_hash(self, live_server: LiveServer) -> None:
        world = make_world(live_server, BIG)
        known = [secrets.randbelow(1001) for _ in range(30)]
        prefix = b"income\n" + b"".join(f"{v}\n".encode() for v in known)
        hidden = secrets.randbelow(1001)
        schema = {
            "columns": [{"name": "income", "type": "int", "min": 0, "max": 1000}],
            "neighboring": "add_remove",
        }
        dataset_id = add_dataset(world, prefix + f"{hidden}\n".encode(), schema, BIG)
        published = world.analyst.get(f"/v1/datasets/{dataset_id}").json()["content_sha256"]
        recovered = next(
            (c for c in range(1001) if hashlib.sha256(prefix + f"{c}\n".encode()).hexdigest() == published),
            None,
        )
        expect(recovered is None, f"the analyst recovered the hidden row exactly: {recovered} (was {hidden})")

    def test_a_viewer_reads_the_private_row_count_of_an_add_remove_dataset(
        self, live_server: LiveServer
    ) -> None:
        world = make_world(live_server, BIG, schema={**SCHEMA, "neighboring": "add_remove"})
        assert world.viewer.get(f"/v1/datasets/{world.dataset_id}").json()["n_rows"] is None  # hidden here
        entry = next(e for e in ledger_items(world.viewer, world.dataset_id) if e["event"] == "dataset")
        expect("n_rows" not in entry, f"viewer sees n_rows = {entry.get('n_rows')}")
