"""Trajectory viewer: rollout records -> ONE self-contained HTML file (inline CSS/JS, no network).

    python eval.py view rollouts.jsonl -o viewer.html                      # segment-level masking
    python eval.py view rollouts.jsonl -o viewer.html --tokenizer MODEL_DIR  # token-level masking
    python eval.py view samples/step_30.jsonl -o v.html --reward search_r1_em  # score unscored records

    from report.viewer import write_viewer
    write_viewer(records, "results/viewer.html", tokenizer=tok, title="tiny / val")

Input: rollout records as rollout.py builds them (`chunks`, `segments`, `response_ids`,
`loss_mask`, `tool_calls`, `finish`, `turns`, ...) with `reward` / `reward_components` added by
`rewards.score` (eval.py --out and train.py's samples/*.jsonl are such files). Records with
only a "response" text (the rewards.py CLI format) work too.

Each trajectory card shows the question, golden answers, final answer (answers.parsed), reward
and every reward component, the searches, turns and finish reason, then the response with
every segment coloured (legend at the top of the page): think, search, information, answer,
tool_call / read, result / tool_response, confidence; untagged text stays white.

Masked tokens (loss_mask = 0: never trained, e.g. retrieved text) are drawn with grey text
on diagonal stripes over their segment colour; trained tokens have plain black text.
  * with a tokenizer (anything with `decode(ids)`, e.g. a HF tokenizer), masking is per token
    from `loss_mask`; each chunk's ids are decoded token by token (prefix decoding where a token
    splits a UTF-8 character) and hovering a token shows its index, id and mask. If the
    decoded ids do not reproduce the chunk texts (wrong tokenizer), the card falls back:
  * without a tokenizer, masking is per chunk: `chunks` with role "tool" are masked, "policy"
    chunks trained; records without chunks mask the observation segments (information,
    result, tool_response). Each card says which mode it used.

Tree rollouts (rollout_tree.py, records with a "tree" field): the leaves of one tree are shown
together under the tree's id, and in each branch the prefix it shares with the leaf it branched
from (copied, not generated: tree.shared_prefix_len tokens) is faded, with where it branched.

Filters: each trajectory gets exactly one kind, first match wins:
  format failure  answers.parsed(record).format_ok is False
  IDK             the parsed answer is an abstention (answers.IDK_ANSWERS)
  correct         record["correct"] if present, else reward_components["em"], else EM of the
                  parsed answer against golden_answers; correct means > 0.5
  wrong           everything else
Checkboxes toggle the kinds, a search box filters on any text of a card; the page shows
"N of M trajectories shown" (also in body[data-shown]). A URL hash sets the initial state:
viewer.html#show=wrong,idk&q=velor .
"""

from __future__ import annotations

import argparse
import json
import sys
from bisect import bisect_right
from html import escape
from pathlib import Path

from agent.answers import OBSERVATIONS, exact_match, golden_of, parsed, split_segments
from rewards import score
from trainer.engine import load_tokenizer

# Segment colours (backgrounds). read shares tool_call's colour, tool_response shares result's.
COLOURS = {
    "think": "#bfdbfe",
    "search": "#fde047",
    "information": "#bbf7d0",
    "answer": "#f9a8d4",
    "tool_call": "#fdba74",
    "result": "#a5f3fc",
    "confidence": "#d8b4fe",
}
ALIASES = {"read": "tool_call", "tool_response": "result"}
LEGEND = {"tool_call": "tool_call / read", "result": "result / tool_response"}
KINDS = {"correct": "correct", "wrong": "wrong", "idk": "IDK", "format": "format failure"}

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;padding:10px 16px;color:#111;background:#fff}
h1{font-size:18px;margin:0 0 6px}
.bar{display:flex;flex-wrap:wrap;gap:6px 14px;align-items:center;margin-bottom:6px}
.sw{display:inline-block;width:12px;height:12px;border:1px solid #888;vertical-align:-2px;margin-right:3px}
.card{border:1px solid #ccc;border-radius:6px;padding:6px 10px;margin:8px 0}
[hidden]{display:none!important}
.facts{display:flex;flex-wrap:wrap;gap:2px 14px;font-size:13px;margin:3px 0}
.facts b,.dim{color:#666;font-weight:normal}
.badge{color:#fff;border-radius:4px;padding:0 6px;font-size:12px;margin-right:6px}
.b-correct{background:#15803d}.b-wrong{background:#b91c1c}.b-idk{background:#475569}.b-format{background:#92400e}
.resp{font:13px/1.5 ui-monospace,monospace;white-space:pre-wrap;word-break:break-word;margin-top:4px;
  border-top:1px dashed #ddd;padding-top:4px}
.m{color:#555;background-image:repeating-linear-gradient(135deg,rgba(0,0,0,.14) 0 2px,transparent 2px 6px)}
#q{width:220px}
.tree{border-left:4px solid #6366f1;padding-left:8px;margin:10px 0}.tree>summary{font-weight:600;color:#4338ca}
.sh{opacity:.5}
""" + "".join(f".s-{k}{{background-color:{v}}}" for k, v in COLOURS.items())

JS = """
(function () {
  var cards = Array.prototype.slice.call(document.querySelectorAll('.card'));
  var boxes = Array.prototype.slice.call(document.querySelectorAll('input[data-kind]'));
  var q = document.getElementById('q'), count = document.getElementById('count');
  function apply() {
    var on = {}, s = q.value.trim().toLowerCase(), n = 0;
    boxes.forEach(function (b) { on[b.dataset.kind] = b.checked; });
    cards.forEach(function (c) {
      var show = on[c.dataset.kind] && (!s || c.textContent.toLowerCase().indexOf(s) >= 0);
      c.hidden = !show; if (show) n++;
    });
    count.textContent = n + ' of ' + cards.length + ' trajectories shown';
    document.body.setAttribute('data-shown', String(n));
  }
  var h = new URLSearchParams(location.hash.slice(1));
  if (h.has('show')) {
    var kinds = h.get('show').split(',');
    boxes.forEach(function (b) { b.checked = kinds.indexOf(b.dataset.kind) >= 0; });
  }
  if (h.has('q')) q.value = h.get('q');
  boxes.forEach(function (b) { b.addEventListener('change', apply); });
  q.addEventListener('input', apply);
  apply();
})();
"""


def is_correct(record: dict) -> bool:
    """record["correct"], else reward_components["em"], else EM of the parsed answer; > 0.5."""
    if isinstance(record.get("correct"), (int, float)):
        return record["correct"] > 0.5
    em = (record.get("reward_components") or {}).get("em")
    if isinstance(em, (int, float)):
        return em > 0.5
    return exact_match(parsed(dict(record)).answer, golden_of(record)) > 0.5


def kind_of(record: dict) -> str:
    """One of format / idk / correct / wrong (the module docstring gives the order)."""
    p = parsed(dict(record))  # a copy: the parse is cached on it, not on the caller's record
    if not p.format_ok:
        return "format"
    if p.idk:
        return "idk"
    return "correct" if is_correct(record) else "wrong"


def response_text(record: dict) -> str:
    if record.get("chunks"):
        return "".join(c["text"] for c in record["chunks"])
    text = record.get("response", record.get("response_text", ""))
    return text if isinstance(text, str) else ""


def segment_spans(record: dict, text: str) -> list[tuple[int, int, str]]:
    """(start, end, colour key) of each tagged segment in text, tags included. Uses the record's
    `segments` (answers.split_segments output, in order) and finds each one after the last."""
    spans, pos = [], 0
    for seg in record.get("segments") or split_segments(text, True):
        kind = seg.get("type", "text")
        needle = seg.get("text", "") if kind == "text" else f"<{kind}>{seg.get('text', '')}</{kind}>"
        at = text.find(needle, pos)
        if at < 0:
            continue  # does not match the text (an edited record): leave it uncoloured
        pos = at + len(needle)
        key = ALIASES.get(kind, kind)
        if key in COLOURS:
            spans.append((at, pos, key))
    return spans


def _token_units(record: dict, text: str, tokenizer) -> list[tuple[int, int, bool | None, str]] | None:
    """Per-token (start, end, masked, hover) over text, or None when the ids do not decode to it."""
    ids, mask = record.get("response_ids") or [], record.get("loss_mask") or []
    if not ids or len(ids) != len(mask):
        return None
    chunks = record.get("chunks") or [{"start": 0, "end": len(ids), "text": text}]
    dec = lambda t: tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
    units, offset, next_id = [], 0, 0
    for c in chunks:
        ctext, toks = c["text"], ids[c["start"] : c["end"]]
        if c["start"] != next_id:
            return None
        pieces = [dec([t]) for t in toks]
        if "".join(pieces) == ctext:
            ends, e = [], 0
            for piece in pieces:
                e += len(piece)
                ends.append(e)
        elif dec(toks) == ctext:  # a token splits a character: prefix decoding
            ends, e = [], 0
            for k in range(len(toks)):
                e = min(max(e, len(dec(toks[: k + 1]))), len(ctext))
                ends.append(e)
            ends[-1] = len(ctext)
        else:
            return None
        prev = 0
        for k, e in enumerate(ends):
            if e > prev:
                i = c["start"] + k
                units.append((offset + prev, offset + e, mask[i] == 0, f"token {i} id {ids[i]} loss_mask {mask[i]}"))
            prev = e
        offset += len(ctext)
        next_id = c["end"]
    return units if offset == len(text) and next_id == len(ids) else None


def masking_units(record: dict, text: str, tokenizer=None) -> tuple[list[tuple[int, int, bool | None, str]], str]:
    """Contiguous (start, end, masked, hover) units covering text, and the mode used.
    masked None means "decide by segment": observation segments are masked."""
    if tokenizer is not None:
        units = _token_units(record, text, tokenizer)
        if units is not None:
            return units, "per token"
    if record.get("chunks"):
        units, pos = [], 0
        for c in record["chunks"]:
            role = c.get("role", "policy")
            units.append(
                (pos, pos + len(c["text"]), role != "policy", f"{role} chunk, tokens {c.get('start')}-{c.get('end')}")
            )
            pos += len(c["text"])
        return units, "per chunk (no tokenizer)" if tokenizer is None else "per chunk (tokenizer mismatch)"
    return [(0, len(text), None, "")], "per segment (no chunks)"


def shared_chars(record: dict) -> int:
    """Characters of the response a tree branch shares with its parent: its chunks that lie within
    tree.shared_prefix_len tokens (0 for a chain or a tree's first chain)."""
    n = (record.get("tree") or {}).get("shared_prefix_len", 0)
    return sum(len(c["text"]) for c in record.get("chunks") or [] if c["end"] <= n) if n else 0


def render_response(record: dict, tokenizer=None) -> tuple[str, str]:
    """HTML of the coloured, mask-shaded response (a tree branch's shared prefix faded) and the masking mode."""
    text = response_text(record)
    units, mode = masking_units(record, text, tokenizer)
    segs = segment_spans(record, text)
    shared = shared_chars(record)
    cuts = sorted({0, len(text), shared, *(u[0] for u in units), *(s[0] for s in segs), *(s[1] for s in segs)})
    ustarts, sstarts = [u[0] for u in units], [s[0] for s in segs]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        _, _, masked, hover = units[bisect_right(ustarts, a) - 1]
        j = bisect_right(sstarts, a) - 1
        key = segs[j][2] if j >= 0 and a < segs[j][1] else ""
        if masked is None:
            masked = key in {ALIASES.get(o, o) for o in OBSERVATIONS}
        cls = " ".join(c for c in (f"s-{key}" if key else "", "m" if masked else "", "sh" if a < shared else "") if c)
        attrs = (f' class="{cls}"' if cls else "") + (f' title="{escape(hover)}"' if hover else "")
        out.append(f"<span{attrs}>{escape(text[a:b])}</span>")
    return "".join(out), mode


def _num(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else escape(str(v))


def render_card(record: dict, index: int, tokenizer=None) -> str:
    p = parsed(dict(record))
    kind = kind_of(record)
    comps = record.get("reward_components") or {}
    comp_text = " ".join(f"{escape(str(k))}={_num(v)}" for k, v in comps.items()) or "—"
    calls = record.get("tool_calls")
    queries = [str(c.get("query", "")) for c in calls] if calls is not None else p.queries
    n_search = record.get("num_searches", len(queries))
    answer = p.answer if p.answer is not None else record.get("answer")
    body, mode = render_response(record, tokenizer)
    reward = record.get("reward")
    facts = [
        ("golden", " | ".join(escape(g) for g in golden_of(record)) or "—"),
        ("answer", escape(str(answer)) if answer is not None else "—"),
        ("reward", _num(reward) if reward is not None else "—"),
        ("components", comp_text),
        *([("turn rewards", " · ".join(f"{k}: {_num(v) if v is not None else '—'}"
                                       for k, v in enumerate(record["turn_rewards"], 1)))]
          if record.get("turn_rewards") else []),  # fmt: skip
        ("searches", f"{n_search}" + (": " + "; ".join(f"“{escape(q)}”" for q in queries) if queries else "")),
        ("turns", escape(str(record.get("turns", "—")))),
        ("finish", escape(str(record.get("finish", "—")))),
        ("format", "ok" if p.format_ok else "failed"),
        ("confidence", str(p.confidence) if p.confidence is not None else "—"),
        ("masking", mode),
        *([("branch", f"from sample {t['parent']} after step {t['node']}, {t['shared_prefix_len']} tokens shared")]
          if (t := record.get("tree") or {}).get("parent") is not None else []),  # fmt: skip
    ]
    ident = " · ".join(escape(f"{k} {record[k]}") for k in ("group_id", "sample") if k in record)
    return (
        f'<section class="card" data-kind="{kind}" id="r{index}"><div>'
        f'<span class="badge b-{kind}">{KINDS[kind]}</span><b>#{index}</b> '
        f'{escape(str(record.get("question", "")))} <span class="dim">{ident}</span></div>'
        '<div class="facts">' + "".join(f"<span><b>{k}</b> {v}</span>" for k, v in facts) + "</div>"
        f'<div class="resp">{body}</div></section>'
    )


def render(records: list[dict], tokenizer=None, title: str = "") -> str:
    """The whole page as a string."""
    title = title or "Rollout trajectories"
    kinds = [kind_of(r) for r in records]
    legend = (
        "".join(f'<span><span class="sw s-{k}"></span>{escape(LEGEND.get(k, k))}</span>' for k in COLOURS)
        + '<span><span class="sw"></span>untagged</span><span>trained</span><span class="m">masked (loss_mask 0)</span>'
    )
    filters = "".join(
        f'<label><input type="checkbox" data-kind="{k}" checked> {v} ({kinds.count(k)})</label>'
        for k, v in KINDS.items()
    )
    shown = [render_card(r, i, tokenizer) for i, r in enumerate(records)]
    cards = "\n".join(shown)
    if any("tree" in r for r in records):  # a tree's leaves together, under its id
        trees: dict[str, list[str]] = {}
        for i, (r, card) in enumerate(zip(records, shown)):
            trees.setdefault((r.get("tree") or {}).get("tree_id", f"#{i}"), []).append(card)
        cards = "\n".join(f'<details class="tree" open><summary>tree {escape(t)}: {len(c)} leaves</summary>'
                           + "\n".join(c) + "</details>" for t, c in trees.items())  # fmt: skip
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{CSS}</style></head>\n<body><h1>{escape(title)}</h1>"
        f'<div class="bar">{legend}</div>'
        f'<div class="bar">{filters}<input id="q" type="search" placeholder="search text">'
        f'<span id="count">{len(records)} trajectories</span></div>\n'
        f"<main>\n{cards}\n</main>\n<script>{JS}</script></body></html>\n"
    )


def write_viewer(records: list[dict], path: str | Path, tokenizer=None, title: str = "") -> Path:
    """Write the viewer HTML for `records` to `path` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(records, tokenizer, title), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="eval.py view", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rollouts", help="rollout records, jsonl")
    ap.add_argument("-o", "--output", required=True, help="HTML file to write")
    ap.add_argument("--tokenizer", help="tokenizer directory (the policy's) for per-token masking")
    ap.add_argument("--reward", help="score the records with this reward spec first (rewards.score)")
    ap.add_argument("--title", default="", help="page title (default: the input file name)")
    args = ap.parse_args(argv)
    try:
        with open(args.rollouts, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        sys.exit(f"error: rollouts file not found: {args.rollouts}")
    except json.JSONDecodeError as e:
        sys.exit(f"error: {args.rollouts} is not jsonl: {e}")
    if not all(isinstance(r, dict) for r in records):
        sys.exit(f"error: {args.rollouts}: every line must be a JSON object")
    if args.reward:
        score(records, args.reward)
    tokenizer = None
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    out = write_viewer(records, args.output, tokenizer, args.title or Path(args.rollouts).name)
    print(f"wrote {len(records)} trajectories to {out}")


if __name__ == "__main__":
    main()
