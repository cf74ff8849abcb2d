"""report/viewer.py: the trajectory viewer, rendered for real in headless Chromium.

Records come from the real code path: a scripted engine (fixed completions, as in
test_masking.py) drives rollout.rollout_batch with a real byte-level BPE tokenizer
(sft.train_tokenizer), and rewards.score attaches the rewards. One record of each kind:
correct, wrong, IDK (with a confidence), format failure, a response holding a <script> tag,
and a BAPO-style tool_call / result record. rollout.py has no tool_call loop, so that one's
state is filled by hand and turned into a record by rollout._record, as rollout_batch does.

Chromium (Debian `chromium`) must be installed; the test fails, not skips, without it. Set
VIEWER_SCREENSHOT_OUT=1 (or a path) to keep the screenshot (default results/viewer_screenshot.png).
"""

import json
import os
import re
import shutil
import subprocess
import time
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from matplotlib import image as mpimg

from report import viewer
from rewards import score
from rollout import _record, _State, rollout_batch
from tiny.sft import train_tokenizer
from trainer.config import Config
from trainer.engine import Completion

SEARCH = "<think> find Tavi</think><search> Tavi Morek born</search>"
HIT = "Doc 1(Title: Tavi Morek) Tavi Morek was born in Velor, near Zürich."  # ü: 2 byte tokens
SCRIPT = "<script>document.body.setAttribute('data-pwned','1')</script>"
CASES = {  # name -> (scripted policy turns, finish reason of the last turn)
    "correct": ([SEARCH, "<think> born in Velor</think><answer> Velor</answer>"], "stop"),
    "wrong": ([SEARCH, "<think> born in Ostra</think><answer> Ostra</answer>"], "stop"),
    "idk": (["<think> no idea</think><confidence>2</confidence><answer> I don't know</answer>"], "stop"),
    "format": (["Velor maybe, I will not use any tags"], "length"),
    "script": ([f"<think> {SCRIPT} it is</think><answer> Velor</answer>"], "stop"),
}
BAPO_CHUNKS = [
    ("policy", '<think> look up</think><tool_call>{"name": "search", "arguments": {"query": "Tavi"}}</tool_call>'),
    ("tool", "\n<result>Doc 1(Title: Tavi Morek) born in Velor</result>\n"),
    ("policy", "<think> Velor it is</think><confidence>9</confidence><answer> \\boxed{Velor}</answer>"),
]


class ScriptedEngine:
    def __init__(self, tokenizer, turns: list[str], last_finish: str):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.last_finish, self.calls = last_finish, 0

    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None):
        k = min(self.calls, len(self.turns) - 1)
        self.calls += 1
        finish = self.last_finish if k == len(self.turns) - 1 else "stop"
        return [Completion(list(self.turns[k]), [-0.5] * len(self.turns[k]), finish) for _ in prompts]


def bapo_record(tok) -> dict:
    s = _State({"id": "q6", "question": "Where was Tavi born?", "golden_answers": ["Velor"]}, "g6", 0, [1, 2])
    for role, text in BAPO_CHUNKS:
        ids = tok.encode(text, add_special_tokens=False)
        start = len(s.response_ids)
        s.response_ids += ids
        s.loss_mask += [int(role == "policy")] * len(ids)
        s.logprobs += [0.0] * len(ids)
        s.chunks.append({"role": role, "text": tok.decode(ids), "start": start, "end": len(s.response_ids)})
    s.tool_calls.append({"turn": 1, "query": "Tavi", "result": BAPO_CHUNKS[1][1]})
    s.finish, s.turns = "answer", 2
    return _record(s, tok)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("viewer")
    texts = [f"{HIT} {turn} " * 5 for turns, _ in CASES.values() for turn in turns]
    tok = train_tokenizer(texts * 20, 300, tmp / "tok")
    cfg = Config()
    records = []
    for i, (name, (turns, finish)) in enumerate(CASES.items()):
        q = {"id": f"q{i}", "question": f"Where was <i>Tavi</i> born? ({name})", "golden_answers": ["Velor"]}
        engine = ScriptedEngine(tok, turns, finish)
        records += rollout_batch(engine, tok, [q], 1, lambda qs: [HIT] * len(qs), cfg.rollout)
    score(records, "search_r1_em")
    records += score([bapo_record(tok)], "0.5*em + 0.5*bapo")
    return tmp, tok, records


class Spans(HTMLParser):
    """(card kind, span classes, text) of every span inside a response."""

    def __init__(self):
        super().__init__()
        self.kind, self.in_resp, self.cls, self.spans = None, False, None, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.kind = a.get("data-kind")
        elif tag == "div" and a.get("class") == "resp":
            self.in_resp = True
        elif tag == "span" and self.in_resp:
            self.cls = (a.get("class") or "").split()

    def handle_endtag(self, tag):
        if tag == "section":
            self.in_resp = False

    def handle_data(self, data):
        if self.in_resp and self.cls is not None:
            self.spans.append((self.kind, self.cls, data))
            self.cls = None


def spans_of(html: str) -> list[tuple[str, list[str], str]]:
    p = Spans()
    p.feed(html)
    return p.spans


def test_records_have_one_of_each_kind(built):
    _, _, records = built
    assert [viewer.kind_of(r) for r in records] == ["correct", "wrong", "idk", "format", "correct", "correct"]
    assert records[0]["num_searches"] == 1 and records[3]["finish"] == "length"


def test_html_is_escaped_and_self_contained(built):
    tmp, tok, records = built
    assert viewer.render(records, tokenizer=tok).count("<script") == 1  # only the viewer's own script
    html = viewer.write_viewer(records, tmp / "v.html").read_text()  # per chunk: the tag stays in one span
    assert html.count("<script") == 1
    assert "&lt;script&gt;document.body.setAttribute(&#x27;data-pwned&#x27;" in html
    assert "<i>Tavi</i>" not in html and "&lt;i&gt;Tavi&lt;/i&gt;" in html
    for bad in ("http://", "https://", "<link", "@import", "url(", " src="):
        assert bad not in html


def test_token_masking_follows_loss_mask_and_text_is_exact(built):
    tmp, tok, records = built
    spans = spans_of(viewer.render(records, tokenizer=tok))
    cards = [[s for s in spans if s[0] == k] for k in ("correct", "wrong", "idk", "format")]
    assert all(cards)
    tool = records[0]["chunks"][1]
    ids = records[0]["response_ids"][tool["start"] : tool["end"]]
    assert "".join(tok.decode([i]) for i in ids) != tool["text"]  # so the prefix decoding path runs
    for r in records:
        body, mode = viewer.render_response(r, tok)
        assert mode == "per token"
        sp = spans_of(f'<section data-kind="x"><div class="resp">{body}</div></section>')
        assert "".join(unescape(t) for _, _, t in sp) == r["response_text"]  # incl. the split ü
        masked = "".join(t for _, c, t in sp if "m" in c)
        assert masked == "".join(c["text"] for c in r["chunks"] if c["role"] == "tool")
    # the no-mask ablation (loss_mask all 1): per token shows everything trained, per chunk cannot know
    ablated = dict(records[0], loss_mask=[1] * len(records[0]["loss_mask"]))
    assert ' m"' not in viewer.render_response(ablated, tok)[0]
    body, mode = viewer.render_response(ablated)
    assert mode == "per chunk (no tokenizer)" and 'class="s-information m"' in body

    class WrongTokenizer:
        def decode(self, ids, **_):
            return "?" * len(ids)

    assert viewer.render_response(records[0], WrongTokenizer())[1] == "per chunk (tokenizer mismatch)"
    bare = {"response": records[0]["response_text"], "golden_answers": ["Velor"]}  # rewards CLI format
    body, mode = viewer.render_response(bare)
    assert mode == "per segment (no chunks)" and 'class="s-information m"' in body and 'class="s-think"' in body


def test_every_segment_colour_is_used(built):
    _, tok, records = built
    classes = {c for _, cls, _ in spans_of(viewer.render(records, tokenizer=tok)) for c in cls}
    assert {f"s-{k}" for k in viewer.COLOURS} <= classes


def chromium(args: list[str], url: str, profile: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(exe).exists():
        pytest.fail("chromium not found: install Debian's chromium (apt-get install -y chromium)")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--force-color-profile=srgb", "--hide-scrollbars", f"--user-data-dir={profile}",
           "--window-size=1200,1600", *args, url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_chromium_renders_filters_and_colours(built):
    tmp, tok, records = built
    page = viewer.write_viewer(records, tmp / "chrome.html", tokenizer=tok, title="viewer test")
    url, t0 = page.resolve().as_uri(), time.time()
    dom = chromium(["--dump-dom"], url, tmp / "p1").stdout
    assert 'data-shown="6"' in dom and "6 of 6 trajectories shown" in dom  # the inline JS ran
    assert "data-pwned" not in dom.split("<main>")[0] and 'data-pwned="1"' not in dom  # escaped, never run
    dom = chromium(["--dump-dom"], url + "#show=wrong,idk", tmp / "p2").stdout
    assert 'data-shown="2"' in dom and "2 of 6 trajectories shown" in dom
    cards = re.findall(r"<section ([^>]*)>", dom)
    visible = {re.search(r'data-kind="(\w+)"', a).group(1) for a in cards if "hidden" not in a}
    assert len(cards) == 6 and sum("hidden" in a for a in cards) == 4
    assert visible == {"wrong", "idk"}
    dom = chromium(["--dump-dom"], url + "#q=ostra", tmp / "p3").stdout
    assert 'data-shown="1"' in dom

    png = tmp / "shot.png"
    chromium([f"--screenshot={png}"], url, tmp / "p4")
    elapsed = time.time() - t0
    pixels = np.round(mpimg.imread(png)[..., :3] * 255).astype(int)
    assert pixels.shape[:2] == (1600, 1200)
    counts = {}
    for key, hexcode in viewer.COLOURS.items():
        rgb = np.array([int(hexcode[i : i + 2], 16) for i in (1, 3, 5)])
        counts[key] = int((np.abs(pixels - rgb).max(axis=-1) <= 3).sum())
    # a legend swatch is 12x12 = 144 pixels: each colour must also fill real segments
    assert all(n > 1000 for n in counts.values()), counts
    print(f"chromium: 4 runs in {elapsed:.1f}s; pixels per colour {counts}")
    keep = os.environ.get("VIEWER_SCREENSHOT_OUT")
    if keep:
        dest = ROOT / "results" / "viewer_screenshot.png" if keep in ("1", "true", "yes") else Path(keep)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, dest)


def test_cli_writes_the_page(built, tmp_path):
    _, _, records = built
    src = tmp_path / "rollouts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    viewer.main([str(src), "-o", str(tmp_path / "out.html"), "--tokenizer", str(built[0] / "tok")])
    html = (tmp_path / "out.html").read_text()
    assert html.count('<section class="card"') == 6 and "per token" in html and "rollouts.jsonl" in html
