"""One ``kvaudit diff`` run's every report form read back: the table (stdout), the JSON,
the JUnit failure messages and the HTML page's diagnosis items, so that tests can check
that each names the same fault in its first lines."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

from click.testing import CliRunner

from kvaudit.cli import main


class Findings(HTMLParser):
    """The page's diagnosis items: each ``li.finding``'s kind and text."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[tuple[str, str]] = []
        self.inside = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        if tag == "li" and attributes.get("class") == "finding":
            self.items.append((attributes["data-kind"], ""))
            self.inside = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "li":
            self.inside = False

    def handle_data(self, data: str) -> None:
        if self.inside:
            kind, text = self.items[-1]
            self.items[-1] = (kind, text + data)


def reports(producer: Path, consumer: Path, out: Path, *extra: str) -> dict:
    """One run's exit status, table lines (stdout), JSON, HTML items and (not with
    ``--numeric``) JUnit failure messages."""
    out.mkdir(exist_ok=True)
    paths = {name: out / f"report.{name}" for name in ("json", "xml", "html")}
    result = CliRunner().invoke(
        main,
        [
            *("diff", str(producer), str(consumer), "--device", "cpu", *extra),
            *("--json", str(paths["json"]), "--html", str(paths["html"])),
            *(("--junit", str(paths["xml"])) if "--numeric" not in extra else ()),
        ],
    )
    page = Findings()
    page.feed(paths["html"].read_text())
    found = {
        "status": result.exit_code,
        "table": result.stdout.splitlines(),
        "json": json.loads(paths["json"].read_text()),
        "html": page.items,
    }
    if paths["xml"].exists():
        cases = ET.parse(paths["xml"]).getroot().iter("testcase")
        found["junit"] = [c.find("failure").get("message") for c in cases if len(c)]
    return found
