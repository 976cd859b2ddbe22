"""Screenshot one episode's trace in the MLflow UI with a real headless browser (docs/images/ in rollouts.md).

Needs playwright (not an agentrl dependency: `pip install playwright` in any environment) and a Chromium
(`playwright install chromium`, or the distribution's: `apt-get install chromium` and `--chromium /usr/bin/chromium`),
plus a running `mlflow server --backend-store-uri sqlite:///RUN/mlflow.db --host 127.0.0.1 --port 5000`.

    python scripts/mlflow_trace_screenshot.py http://127.0.0.1:5000 EXPERIMENT_ID TRACE_ID out.png --span "tool_agent call 2"
"""

from __future__ import annotations

import argparse

from playwright.sync_api import sync_playwright


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("experiment_id")
    parser.add_argument("trace_id")
    parser.add_argument("output")
    parser.add_argument("--span", help="name of the span to select (default: the root)")
    parser.add_argument("--chromium", help="a Chromium binary instead of playwright's own")
    parser.add_argument("--size", default="1280x640", help="viewport WIDTHxHEIGHT")
    ns = parser.parse_args()
    width, height = map(int, ns.size.split("x"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=ns.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(f"{ns.url}/#/experiments/{ns.experiment_id}/traces?selectedEvaluationId={ns.trace_id}")
        page.wait_for_timeout(8000)  # the UI loads the trace list, then the trace
        page.mouse.click(92, 23)  # the drawer's full-screen toggle, left of the title "Trace"
        page.wait_for_timeout(2000)
        if ns.span:
            page.get_by_text(ns.span, exact=True).first.click(timeout=10000)
            page.wait_for_timeout(2500)
        page.screenshot(path=ns.output)
        browser.close()


if __name__ == "__main__":
    main()
