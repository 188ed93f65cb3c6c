"""``diff --html``: one self-contained page (no script, nothing fetched), its heatmaps
and tables; opened in a real headless Chromium with the network off, when one is
installed (Debian: ``apt-get install chromium``)."""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers.valued_sets import ATTN, CONSUMER, HEADS, PRODUCER, draw, dump, model

from kvaudit.cli import main

CHROMIUM = next(
    (found for name in ("chromium", "chromium-browser") if (found := shutil.which(name))), None
)


class _Page(HTMLParser):
    """What a page links to, its images and its table cells with a ``data-field``."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.images: list[dict[str, str]] = []
        self.tags: set[str] = set()
        self.cells: dict[tuple[str, str, str, str], str] = {}
        self._cell: tuple[str, str, str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {key: value or "" for key, value in attrs}
        self.tags.add(tag)
        self.links += [found[key] for key in ("src", "href") if key in found]
        if tag == "img":
            self.images.append(found)
        if tag == "td" and "data-field" in found:
            self._cell = (
                found["data-request"],
                found["data-layer"],
                found["data-head"],
                found["data-field"],
            )

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self.cells[self._cell] = self.cells.get(self._cell, "") + data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None


def parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def shown(value: float | str | None) -> str:
    """A JSON number as the page shows it."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.6g}"


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit, non-interlaced RGB or RGBA PNG as ``[height, width, channels]``."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, idat, header = 8, b"", b""
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        offset += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and interlace == 0
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.int64)
    previous = np.zeros(stride, dtype=np.int64)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int64)
        if kind == 0:
            row = line
        elif kind == 1:  # sub: a running sum per channel
            row = np.cumsum(line.reshape(-1, channels), axis=0).reshape(-1) & 0xFF
        elif kind == 2:
            row = (line + previous) & 0xFF
        else:
            row = _average_or_paeth(kind, line, previous, channels)
        out[y] = previous = row
    return out.reshape(height, width, channels)[..., :3].astype(np.uint8)


def _average_or_paeth(
    kind: int, line: np.ndarray, previous: np.ndarray, channels: int
) -> np.ndarray:
    """One scanline of filter 3 (average) or 4 (Paeth), byte by byte."""
    row = np.zeros(len(line), dtype=np.int64)
    for x in range(len(line)):
        left = row[x - channels] if x >= channels else 0
        up = previous[x]
        corner = previous[x - channels] if x >= channels else 0
        if kind == 3:
            predicted = (left + up) // 2
        else:
            p = left + up - corner
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
            predicted = left if pa <= pb and pa <= pc else up if pb <= pc else corner
        row[x] = (line[x] + predicted) & 0xFF
    return row


@pytest.fixture(scope="module")
def swapped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict]:
    """A head swap in layer 2 (heads 1 and 2): the numeric diff's JSON and HTML."""
    folder = tmp_path_factory.mktemp("html")
    the_model = model("bfloat16", layers=4)
    values = draw(11, the_model)
    broken = {rid: dict(layers) for rid, layers in values.items()}
    for rid in broken:
        layer = broken[rid][ATTN.format(2)].copy()
        layer[:, [1, 2]] = layer[:, [2, 1]]
        broken[rid][ATTN.format(2)] = layer
    left = dump(folder / "p", the_model, values, PRODUCER, "producer")
    right = dump(folder / "c", the_model, broken, CONSUMER, "consumer")
    page = folder / "report.html"
    result = CliRunner().invoke(
        main,
        [
            *("diff", str(left), str(right), "--numeric", "--rtol", "0.01"),
            *("--format", "json", "--html", str(page), "-q"),
        ],
    )
    assert result.exit_code == 1, result.output
    return left, right, page, json.loads(result.output)


def test_page_is_self_contained(swapped: tuple[Path, Path, Path, dict]) -> None:
    text = swapped[2].read_text(encoding="utf-8")
    page = parse(text)
    assert not {"script", "link", "iframe", "object"} & page.tags
    assert all(link.startswith("data:image/png;base64,") for link in page.links)
    assert not re.search(r"https?://|url\(", text)
    assert len(page.images) == 2 * 2  # two requests, two heatmaps each


def test_page_numbers_match_the_json(swapped: tuple[Path, Path, Path, dict]) -> None:
    data = swapped[3]
    page = parse(swapped[2].read_text(encoding="utf-8"))
    checked = 0
    for request in data["requests"]:
        for item in request["groups"][0]["slices"]:
            for field in ("max_abs_error", "max_rel_error", "rms_error", "over_tolerance"):
                key = (request["request"], item["layer"], str(item["head"]), field)
                if key in page.cells:
                    assert page.cells[key] == shown(item[field]), key
                    checked += 1
    assert checked == 2 * 4 * HEADS * 4  # every slice fits the table: all shown


def test_bitwise_diff_page_counts_mismatches(tmp_path: Path) -> None:
    the_model = model("bfloat16", layers=2)
    values = draw(12, the_model)
    broken = {rid: dict(layers) for rid, layers in values.items()}
    layer = broken["req-a"][ATTN.format(1)].copy()
    layer[5, 3, 0] += 1.0
    broken["req-a"][ATTN.format(1)] = layer
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, broken, CONSUMER, "consumer")
    page_path = tmp_path / "diff.html"
    plain = CliRunner().invoke(main, ["diff", str(left), str(right), "-q"])
    result = CliRunner().invoke(
        main, ["diff", str(left), str(right), "--html", str(page_path), "-q"]
    )
    assert result.exit_code == plain.exit_code == 1
    assert result.output == plain.output  # --html adds a file, the report stays as it is
    text = page_path.read_text(encoding="utf-8")
    assert "mismatch count" in text and "Request req-a, group 0" in text
    # Every group is in the summary table; only those with located differences pictured.
    assert 'data-request="req-a"' in text and 'data-request="req-b"' not in text
    rows = re.findall(r'<tr class="(ok|failed)"><td class="name">([^<]*)</td><td>0</td>', text)
    assert rows == [("failed", "req-a"), ("ok", "req-b")]

    # Nothing located (a consumer that lacks tokens): the table says why it failed.
    short = {rid: {n: v[:20] for n, v in layers.items()} for rid, layers in values.items()}
    right = dump(tmp_path / "short", the_model, short, CONSUMER, "consumer")
    result = CliRunner().invoke(main, ["diff", str(left), str(right), "--html", str(page_path)])
    text = page_path.read_text(encoding="utf-8")
    assert result.exit_code == 1 and "Verdict: <b>FAILED</b>" in text
    assert re.search(
        r'<tr class="failed"><td class="name">req-a</td><td>0</td><td>\d+</td>'
        r"<td>0</td><td></td><td>[1-9]",
        text,
    )
    assert "No located difference." in text


def _chromium(page: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Chromium, headless, on ``page`` with no network: in a network namespace of its own
    where ``unshare -n`` works, and with every host name unresolvable anyway."""
    command = [
        CHROMIUM or "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=127.0.0.1:9",
        *args,
        page.as_uri(),
    ]
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        command = [unshare, "-n", *command]
    return subprocess.run(command, capture_output=True, timeout=120, check=True)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_chromium_renders_the_page_offline(
    swapped: tuple[Path, Path, Path, dict], tmp_path: Path
) -> None:
    page = swapped[2]
    dom = _chromium(page, "--dump-dom").stdout.decode("utf-8")
    loaded = parse(dom)
    assert len(loaded.images) == 4
    data = swapped[3]
    for request in data["requests"]:
        for item in request["groups"][0]["slices"]:
            key = (request["request"], item["layer"], str(item["head"]), "max_rel_error")
            assert loaded.cells[key] == shown(item["max_rel_error"])
    shot = tmp_path / "shot.png"
    _chromium(page, f"--screenshot={shot}", "--window-size=1400,1200")
    pixels = decode_png(shot.read_bytes()).reshape(-1, 3).astype(np.int64)
    # The swapped heads' cells and layer 2's token row are dark red: the heatmaps rendered.
    red = (pixels[:, 0] > 100) & (pixels[:, 1] < 60) & (pixels[:, 2] < 80)
    assert red.sum() > 2000
    assert len(np.unique(pixels, axis=0)) > 10


def test_control_characters_of_a_request_id_are_shown_escaped(tmp_path: Path) -> None:
    """An ESC (and a C1 control) in a request id reach the page as the terminal shows
    them (``\\x1b``), never raw."""
    the_model = model("bfloat16", layers=2)
    values = {"req\x1b[31m-red\x9b": draw(12, the_model)["req-a"]}
    broken = {rid: dict(layers) for rid, layers in values.items()}
    layer = broken["req\x1b[31m-red\x9b"][ATTN.format(1)].copy()
    layer[5, 3, 0] += 1.0
    broken["req\x1b[31m-red\x9b"][ATTN.format(1)] = layer
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, broken, CONSUMER, "consumer")
    page = tmp_path / "diff.html"
    result = CliRunner().invoke(main, ["diff", str(left), str(right), "--html", str(page), "-q"])
    assert result.exit_code == 1, result.output
    text = page.read_text(encoding="utf-8")
    assert "\x1b" not in text and "\x9b" not in text
    assert "req\\x1b[31m-red\\x9b" in text


class _Figures(HTMLParser):
    """Each heatmap figure of a page: its image's attributes, its row labels (and which
    are marked), its axis ticks, its marked runs and the text naming them."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: list[dict] = []
        self._in: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {key: value or "" for key, value in attrs}
        classes = found.get("class", "").split()
        if tag == "figure":
            self.figures.append(
                {"title": found["data-title"], "rows": [], "marked": [], "ticks": [], "bars": []}
            )
        figure = self.figures[-1] if self.figures else None
        if figure is not None:
            if tag == "img":
                figure["img"] = found
            if "tick" in classes:
                figure["ticks"].append(int(found["data-at"]))
            if "bar" in classes:
                figure["bars"].append((int(found["data-first"]), int(found["data-last"])))
        self._in.append("row" if self._in[-1:] == ["labels"] else classes[0] if classes else tag)
        if tag == "div" and self._in[-1] == "row" and "marked" in classes:
            self._in[-1] = "marked-row"

    def handle_endtag(self, tag: str) -> None:
        if tag != "img" and self._in:
            self._in.pop()

    def handle_data(self, data: str) -> None:
        if not self.figures or not self._in:
            return
        figure = self.figures[-1]
        if self._in[-1] in ("row", "marked-row"):
            figure["rows"].append(data)
            if self._in[-1] == "marked-row":
                figure["marked"].append(data)
        if self._in[-1] == "runs":
            figure["runs"] = data


def figures(text: str) -> dict[str, dict]:
    """The page's figures by title (one request and group pictured)."""
    parser = _Figures()
    parser.feed(text)
    return {figure["title"]: figure for figure in parser.figures}


def cells(figure: dict) -> np.ndarray:
    """The RGB cells of a figure's inline PNG ``[rows, columns, 3]`` (one pixel a cell)."""
    src = figure["img"]["src"]
    return decode_png(base64.b64decode(src.split(",", 1)[1])).astype(np.int64)


def test_bitwise_pictures_span_the_whole_request_and_mark_the_flip(tmp_path: Path) -> None:
    """A flip at one token and head below the last (head 1 of 4, token 37 of 77): the
    axes still span every layer, head and token, and the flip is marked where it is."""
    layers, tokens, head, token = 3, 77, 1, 37
    the_model = model("bfloat16", layers=layers)
    values = draw(21, the_model, {"req-a": tokens})
    broken = {rid: dict(layer) for rid, layer in values.items()}
    changed = broken["req-a"][ATTN.format(1)].copy()
    changed[token, head, 0] += 1.0
    broken["req-a"][ATTN.format(1)] = changed
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, broken, CONSUMER, "consumer")
    page = tmp_path / "diff.html"
    result = CliRunner().invoke(main, ["diff", str(left), str(right), "--html", str(page), "-q"])
    assert result.exit_code == 1, result.output
    text = page.read_text(encoding="utf-8")
    found = figures(text)
    by_head, by_token = found["layers x heads"], found["layers x tokens"]
    names = [ATTN.format(i) for i in range(layers)]
    for figure in (by_head, by_token):
        assert figure["rows"] == names  # every layer of the group, in order
        assert figure["marked"] == [ATTN.format(1)]
    assert by_head["img"]["data-span"] == str(HEADS) and by_head["img"]["data-columns"] == "4"
    assert by_token["img"]["data-span"] == str(tokens)
    assert by_token["img"]["data-columns"] == str(tokens)  # 77 tokens: one a column
    assert by_head["bars"] == [(head, head)] and by_token["bars"] == [(token, token)]
    assert by_head["runs"] == str(head) and by_token["runs"] == str(token)
    # Ticks: from 0, evenly spaced, inside the axis, the token axis a few of them.
    for figure, extent in ((by_head, HEADS), (by_token, tokens)):
        ticks = figure["ticks"]
        assert ticks[0] == 0 and all(0 <= t < extent for t in ticks)
        steps = {b - a for a, b in itertools.pairwise(ticks[:-1])} or {extent}
        assert len(steps) == 1
    assert by_head["ticks"] == list(range(HEADS))
    assert 3 <= len(by_token["ticks"]) <= 16
    # The PNG: one cell per layer and head (token), the flipped one coloured, none other.
    for figure, column in ((by_head, head), (by_token, token)):
        rgb = cells(figure)
        assert rgb.shape[:2] == (layers, int(figure["img"]["data-columns"]))
        white = (rgb == 255).all(axis=2)
        assert not white[1, column] and white.sum() == white.size - 1
    # The located table names the token, not only a count.
    assert re.search(rf'<td class="tokens" data-count="1">{token} \(1\)</td>', text)


def test_bitwise_picture_of_a_token_range_bins_long_requests(tmp_path: Path) -> None:
    """A request longer than MAX_TOKEN_BINS columns is binned, the axis still to its last
    token; a damaged run of tokens is marked as one range."""
    from kvaudit.formats.heatmaps import MAX_TOKEN_BINS

    tokens = MAX_TOKEN_BINS * 2 + 30
    the_model = model("bfloat16", layers=2)
    values = draw(22, the_model, {"req-a": tokens})
    broken = {rid: dict(layer) for rid, layer in values.items()}
    changed = broken["req-a"][ATTN.format(0)].copy()
    changed[100:116, 2] += 1.0
    broken["req-a"][ATTN.format(0)] = changed
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, broken, CONSUMER, "consumer")
    page = tmp_path / "diff.html"
    CliRunner().invoke(main, ["diff", str(left), str(right), "--html", str(page), "-q"])
    text = page.read_text(encoding="utf-8")
    by_token = figures(text)["layers x tokens"]
    width = -(-tokens // MAX_TOKEN_BINS)
    assert by_token["img"]["data-token-bin"] == str(width)
    assert by_token["img"]["data-columns"] == str(-(-tokens // width))
    assert by_token["img"]["data-span"] == str(tokens)
    assert by_token["bars"] == [(100, 115)] and by_token["runs"] == "100-115"
    # Per block position (16 tokens compared): the located rows of the range.
    assert "100-111 (12)" in text and "112-115 (4)" in text


def _drift(folder: Path, damage: bool) -> tuple[Path, Path, dict, dict]:
    """A bf16 producer and an fp16 consumer of the same values (each rounded its own
    way), layer 1 head 3 of tokens 10..19 scaled by 1.5 where ``damage``: the numeric
    diff's page and JSON, and the values each side holds."""
    bf16, fp16 = model("bfloat16", layers=3), model("float16", layers=3)
    values = draw(23, bf16, {"req-a": 40})
    consumer = {rid: dict(layers) for rid, layers in values.items()}
    if damage:
        changed = consumer["req-a"][ATTN.format(1)].copy()
        changed[10:20, 3] *= 1.5
        consumer["req-a"][ATTN.format(1)] = changed
    left = dump(folder / "p", bf16, values, PRODUCER, "producer")
    right = dump(folder / "c", fp16, consumer, CONSUMER, "consumer")
    page = folder / "numeric.html"
    CliRunner().invoke(
        main,
        [
            *("diff", str(left), str(right), "--numeric", "--atol", "0.001", "--rtol", "0.01"),
            *("--html", str(page), "-q"),
        ],
    )
    return page, folder, values, consumer


def _ratios(values: dict, consumer: dict, layers: int) -> np.ndarray:
    """Per (layer, head) the largest |c - p| / (atol + rtol |p|), from the values cast to
    each side's dtype by torch, in float64."""
    import torch

    out = np.zeros((layers, HEADS))
    for n in range(layers):
        name = ATTN.format(n)
        p = torch.from_numpy(values["req-a"][name]).to(torch.bfloat16).double().numpy()
        c = torch.from_numpy(consumer["req-a"][name]).to(torch.float16).double().numpy()
        ratio = np.abs(c - p) / (0.001 + 0.01 * np.abs(p))
        out[n] = ratio.max(axis=(0, 2))
    return out


def _calm(rgb: np.ndarray) -> np.ndarray:
    """Green or near white: green the largest channel, no red cast."""
    return (rgb[..., 1] >= rgb[..., 0]) & (rgb[..., 1] >= rgb[..., 2])


def _red(rgb: np.ndarray) -> np.ndarray:
    return (rgb[..., 0] > 120) & (rgb[..., 0] > rgb[..., 1] + 80)


@pytest.mark.parametrize("damage", [False, True])
def test_numeric_colours_are_relative_to_the_tolerance(tmp_path: Path, damage: bool) -> None:
    """fp16 against bf16 drifts within atol 0.001 + rtol 0.01: every cell calm; a
    damaged head and its tokens red, marked, and only they."""
    page, _, values, consumer = _drift(tmp_path, damage)
    text = page.read_text(encoding="utf-8")
    want = _ratios(values, consumer, 3)
    assert (want[want < 100] > 0).any()  # the drift is there, below the tolerance
    over = want > 1
    assert over.any() == damage and (not damage or (over.sum() == 1 and over[1, 3]))
    found = figures(text)
    by_head, by_token = found["layers x heads"], found["layers x tokens"]
    rgb = cells(by_head)
    assert (_red(rgb) == over).all() and _calm(rgb[~over]).all()
    assert "error / (atol + rtol |producer|)" in text
    # The table's ratio is the one computed here.
    page_cells = parse(text).cells
    for n in range(3):
        for h in range(HEADS):
            key = ("req-a", ATTN.format(n), str(h), "max_tolerance_ratio")
            assert float(page_cells[key]) == pytest.approx(want[n, h], rel=1e-3)
    tokens = cells(by_token)
    assert by_token["img"]["data-span"] == "40"
    if damage:
        assert by_head["bars"] == [(3, 3)] and by_head["marked"] == [ATTN.format(1)]
        assert by_token["bars"] == [(10, 19)] and by_token["runs"] == "10-19"
        red = _red(tokens)
        assert red[1, 10:20].all() and red.sum() == 10
        assert _calm(tokens[~red]).all()
    else:
        assert by_head["bars"] == by_token["bars"] == [] and "runs" not in by_token
        assert _calm(tokens).all()
