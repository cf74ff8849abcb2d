"""The scripted engine and the fakes the protocol tests share (test_protocols.py,
test_protocols_malformed.py): a character tokenizer and a real BPE (train_bpe), an engine
replaying fixed policy turns, search/web.py-shaped results over three documents (FakeWeb), a
Qwen2.5-style chat template (train_chat_tok), one question rolled out with scripted turns (run),
the bookkeeping every record must keep (check_bookkeeping) and WebFilter's scripted turns."""

import hashlib
import json
import re

from rollout import rollout_batch
from trainer.config import RolloutConfig
from trainer.engine import Completion


class CharTokenizer:
    """One token per character: token counts are string lengths (as in test_metrics.py)."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def train_bpe(tmp_path_factory):
    """A real byte-level BPE (sft.train_tokenizer: the tags are whole tokens), trained in ~1 s."""
    from tiny.sft import train_tokenizer

    texts = ["Tavi Morek was born in the city of Velor. Doc Title information result answer " * 5] * 10
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))


class ScriptedEngine:
    """The engine interface (trainer/engine.py) replaying SCRIPT[qid][k] at turn k.

    The question id is read from the context ("[q3]" in the question text); the turn is the
    number of the script's turns already present, in order, in the context. Token ids are the
    tokenizer's encoding of the scripted text, cut at max_tokens (finish "length"); a turn is
    "stop" unless it is marked ("text", "length"). Logprobs depend on the seed, so seeds are
    pinned too. Every call is logged."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.calls, self.outputs = tokenizer, script, [], []

    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None):
        self.calls.append({"n": len(prompts), "max_tokens": list(max_tokens), "temperature": temperature,
                           "top_p": top_p, "stop": list(stop), "seeds": list(seeds or [])})  # fmt: skip
        out = []
        for i, ids in enumerate(prompts):
            context = self.tok.decode(ids)
            turns = self.script[re.search(r"\[(q\d+)\]", context).group(1)]
            k, pos = 0, 0
            while k < len(turns):
                text = turns[k][0] if isinstance(turns[k], tuple) else turns[k]
                at = context.find(text, pos)
                if at < 0:
                    break
                k, pos = k + 1, at + len(text)
            turn = turns[min(k, len(turns) - 1)]
            text, reason = turn if isinstance(turn, tuple) else (turn, "stop")
            new = self.tok.encode(text, add_special_tokens=False)
            if len(new) > max_tokens[i]:
                new, reason = new[: max_tokens[i]], "length"
            seed = seeds[i] if seeds else 0
            out.append(Completion(new, [-((seed + j) % 997) / 1000 for j in range(len(new))], reason))
        self.outputs += out
        return out


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


DOCS = {  # id: title, url, date, text: the misinformation page disagrees
    "p1": ("Tavi Morek", "https://tinypedia.org/wiki/Tavi_Morek", "2011-03-09", "Tavi Morek was born in Velor."),
    "p2": ("Velor", "https://tinypedia.org/wiki/Velor", "2009-01-02", "Velor is a city of Ostland."),
    "r1": ("Tavi Morek facts", "https://rumormill.net/tavi", "2020-05-05", "Tavi Morek was born in Kesh, sources say."),
}


class FakeWeb:
    """search/web.py's web_search / read result shapes over DOCS; every batched call is logged."""

    def __init__(self):
        self.calls = []

    def search(self, queries):
        self.calls.append(("search", list(queries)))
        out = []
        for q in queries:
            words = [w.lower() for w in q.split() if ":" not in w]
            site = next((w[5:] for w in q.split() if w.startswith("site:")), "")
            if not words:
                out.append({"query": q, "results": [], "error": "the query has no search words, only operators"})
                continue
            hits = [
                {"id": i, "title": t, "url": u, "date": d, "domain": u.split("/")[2], "snippet": x, "score": 1.0}
                for i, (t, u, d, x) in DOCS.items()
                if any(w in (t + " " + x).lower() for w in words) and (not site or site in u)
            ]
            out.append({"query": q, "results": hits, "error": None})
        return out

    def read(self, ids):
        self.calls.append(("read", list(ids)))
        return [
            {"id": i, "title": DOCS[i][0], "url": DOCS[i][1], "date": DOCS[i][2], "text": DOCS[i][3], "error": None}
            if i in DOCS
            else {"id": i, "error": f"no document with id or url {i!r}"}
            for i in ids
        ]

    def tools(self):
        return {"search": self.search, "read": self.read}


CHAT_TEMPLATE = (  # Qwen2.5's layout (system + tools, user, assistant, tool as <tool_response> in a user turn)
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}"
    "{{ messages[0].content + '\\n\\n' }}{% endif %}{{ '# Tools\\n<tools>\\n' }}{% for t in tools %}"
    "{{ t | tojson }}{{ '\\n' }}{% endfor %}{{ '</tools><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{% elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_chat_tok(tmp_path_factory):
    """An "instruct" tokenizer: the BPE plus <|im_start|> / <|im_end|> and a chat template."""
    from tiny.sft import train_tokenizer

    texts = ["Tavi Morek was born in the city of Velor. Doc Title information result answer " * 5] * 10
    tok = train_tokenizer(texts, 300, tmp_path_factory.mktemp("chat"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def question(k="q1"):
    return {"id": k, "question": f"[{k}] Where was Tavi Morek born?", "golden_answers": ["Velor"]}


def run(tok, protocol, turns, tools=None, group_size=1, **cfg_kw):
    """One question rolled out with the scripted turns; returns (records, engine, tools)."""
    cfg = RolloutConfig(protocol=protocol, max_turns=cfg_kw.pop("max_turns", 3), max_tokens_per_turn=400,
                        max_model_len=4096, **cfg_kw)  # fmt: skip
    web = FakeWeb()
    engine = ScriptedEngine(tok, {"q1": turns})
    records = rollout_batch(engine, tok, [question()], group_size, tools or web.tools(), cfg, seed=5)
    return records, engine, web


def check_bookkeeping(r, tok, engine):
    """loss_mask 1 exactly on the policy's tokens, kept as generated; 0 (and logprob 0) on the rest."""
    assert len(r["response_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
    policy_ids = []
    for c in r["chunks"]:
        ids = r["response_ids"][c["start"] : c["end"]]
        assert tok.decode(ids) == c["text"]
        if c["role"] == "policy":
            assert set(r["loss_mask"][c["start"] : c["end"]]) == {1}
            policy_ids += ids
        else:
            assert set(r["loss_mask"][c["start"] : c["end"]]) == {0}
            assert set(r["logprobs"][c["start"] : c["end"]]) == {0.0}
    assert sum(r["loss_mask"]) == len(policy_ids)
    assert [c["start"] for c in r["chunks"][1:]] == [c["end"] for c in r["chunks"][:-1]]
    if all(call["n"] == 1 for call in engine.calls):  # one rollout: its turns are all the engine's outputs
        assert policy_ids == [i for out in engine.outputs for i in out.token_ids]  # exactly as generated
        assert [lp for lp, m in zip(r["logprobs"], r["loss_mask"]) if m] == [
            lp for out in engine.outputs for lp in out.logprobs]  # fmt: skip


def tool_texts(r):
    return [c["text"] for c in r["chunks"] if c["role"] == "tool"]


WF_CALL = ('<think> check a trusted site</think><tool_call>{"name": "search", "arguments": {"queries": '
           '["Tavi Morek born site:tinypedia.org", "Velor city"]}}</tool_call>')  # fmt: skip
WF_ANSWER = "<think> tinypedia says Velor</think><answer> Velor </answer>"
WF_BODY = (
    "Results for Tavi Morek born site:tinypedia.org:\n"
    "[1] Tavi Morek | https://tinypedia.org/wiki/Tavi_Morek | 2011-03-09\nTavi Morek was born in Velor.\n"
    "Results for Velor city:\n"
    "[1] Tavi Morek | https://tinypedia.org/wiki/Tavi_Morek | 2011-03-09\nTavi Morek was born in Velor.\n"
    "[2] Velor | https://tinypedia.org/wiki/Velor | 2009-01-02\nVelor is a city of Ostland."
)
