"""End-to-end tests: the dashboard in a real headless Chromium, and the read endpoints it polls."""
