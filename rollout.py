"""Multi-turn search rollouts (Search-R1's think / search / information / answer loop).

One call, `rollout_batch`, turns questions into rollout records (DESIGN.md §2):

    turn 1:  [prompt] -> policy writes "<think>..</think><search>Tavi Morek born</search>"
             (generation stops on the stop string `</search>`; vLLM never writes past it)
             all active queries of the turn go to the retriever in ONE batched call
             "\\n<information>Doc 1(Title: Tavi Morek) ...</information>\\n" is appended
    turn 2:  policy writes "<think>..</think><answer>Velor</answer>" -> stop on `</answer>`
    the last turn (max_turns) may not search: a search there ends the rollout, unanswered.

Token bookkeeping, the part the reference implementations get wrong (DESIGN §7):
  * the policy's token ids are kept exactly as the engine generated them, never decoded and
    re-encoded; only the appended tool text is tokenised;
  * `loss_mask` is 1 on policy tokens and 0 on retrieved tokens (the prompt is not part of
    the response), so the loss never trains the model to predict what the search engine said
    (Search-R1 §3.1, "retrieved token masking");
  * `logprobs` are the engine's sampling log-probabilities (0.0 on tool tokens), used as
    log pi_old in the PPO ratio;
  * an observation is cut to `max_obs_tokens` *inside* its tags, so `</information>`
    always survives truncation.

Records are plain dicts that serialise to one JSON line; rewards.py and eval.py read only them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from answers import last_block, split_segments
from config import RolloutConfig

TAGS = [
    "<think>", "</think>", "<search>", "</search>",
    "<information>", "</information>", "<answer>", "</answer>",
]  # fmt: skip
STOP = ["</search>", "</answer>"]
OBS_HEAD, OBS_TAIL = "\n<information>", "</information>\n"

# Our own wording of Search-R1's instruction (DESIGN §3): think, search when knowledge is
# missing, read the information, answer briefly.
SEARCH_R1_TEMPLATE = (
    "Answer the question. Reason inside <think> and </think> every time you get new "
    "information. If some knowledge is missing, search for it with <search> query </search>; "
    "the top results come back between <information> and </information>. You may search "
    "as often as you like. When you know the answer, write it inside <answer> and </answer> "
    "with no explanation, for example <answer> Paris </answer>. Question: {question}\n"
)


def render_prompt(question: str, template: str = "") -> str:
    """The plain (base-model) prompt for one question; `template` has a {question} slot."""
    return (template or SEARCH_R1_TEMPLATE).format(question=question.strip())


def observation_ids(tokenizer, body: str, max_tokens: int) -> list[int]:
    """`\\n<information>body</information>\\n` as token ids, the body cut to max_tokens."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return enc(OBS_HEAD) + enc(body)[:max_tokens] + enc(OBS_TAIL)


def tokenize_segments(tokenizer, segments: list[tuple[str, str]], max_obs_tokens: int = 10**9):
    """(text, role) segments -> (ids, loss_mask). Roles: "prompt", "policy" (trained) or "obs".

    "obs" text is the rendered hits; it is wrapped in the information tags and cut like a real
    observation. Each segment is tokenised on its own, as in a rollout, so SFT examples and
    RL rollouts of the same trajectory have identical token ids and masks.
    """
    ids: list[int] = []
    mask: list[int] = []
    for text, role in segments:
        if role == "obs":
            piece = observation_ids(tokenizer, text, max_obs_tokens)
        else:
            piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [1 if role == "policy" else 0] * len(piece)
    return ids, mask


@dataclass
class _State:
    question: dict
    group_id: str
    sample: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    chunks: list[dict] = field(default_factory=list)  # {"role", "text", "start", "end"}
    tool_calls: list[dict] = field(default_factory=list)
    finish: str = ""
    turns: int = 0


def rollout_batch(
    engine,
    tokenizer,
    questions: list[dict],
    group_size: int,
    search_fn,
    cfg: RolloutConfig,
    greedy: bool = False,
    seed: int = 0,
    group_prefix: str = "",
    prefixes: list[list[tuple[str, str]]] | None = None,
) -> list[dict]:
    """Roll out `group_size` trajectories per question; returns rollout records.

    prefixes (eval baselines, eval.py): per question, (text, role) segments the response is
    forced to start with, never trained (loss_mask 0), role "prefix" or "obs" (rendered hits,
    wrapped like an observation), e.g. naive RAG's forced first search:
        [("<think> </think><search> Tavi Morek born</search>", "prefix"), ("Doc 1(...)...", "obs")]

    search_fn(list[str]) -> list[str]: rendered hits for each query, one batched call per turn.
    Group ids are `group_prefix + question id`, so ids from several datasets cannot collide as
    long as question ids are unique within a dataset and the prefix names the dataset.
    """
    states = []
    for qi, q in enumerate(questions):
        prompt_ids = tokenizer.encode(render_prompt(q["question"], cfg.prompt_template), add_special_tokens=False)
        for k in range(group_size):
            states.append(_State(q, group_prefix + str(q["id"]), k, prompt_ids))
            if prefixes is not None:
                _force_prefix(states[-1], prefixes[qi], tokenizer, cfg)
    budget = cfg.max_model_len
    for turn in range(1, cfg.max_turns + 1):
        active = [s for s in states if not s.finish]
        if not active:
            break
        room = [budget - len(s.prompt_ids) - len(s.response_ids) for s in active]
        for s, r in zip(active, room):
            if r < 8:
                s.finish = "length"
        active = [s for s, r in zip(active, room) if r >= 8]
        outs = engine.generate(
            [s.prompt_ids + s.response_ids for s in active],
            max_tokens=[min(cfg.max_tokens_per_turn, r) for r in room if r >= 8],
            temperature=0.0 if greedy else cfg.temperature,
            top_p=1.0 if greedy else cfg.top_p,
            stop=STOP,
            # stable per-rollout seeds (not Python's salted hash): a resumed run samples the same
            seeds=[zlib.crc32(f"{seed}|{s.group_id}|{s.sample}|{turn}".encode()) for s in active],
        )
        pending: list[tuple[_State, str]] = []
        for s, out in zip(active, outs):
            s.turns = turn
            start = len(s.response_ids)
            s.response_ids += out.token_ids
            s.loss_mask += [1] * len(out.token_ids)
            s.logprobs += out.logprobs
            text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
            s.chunks.append({"role": "policy", "text": text, "start": start, "end": len(s.response_ids)})
            if text.rstrip().endswith("</answer>"):
                s.finish = "answer"
            elif text.rstrip().endswith("</search>"):
                query = last_block(text, "search")
                if turn == cfg.max_turns:
                    s.finish = "max_turns"  # the final turn may not search
                elif query is None:
                    s.finish = "format"
                else:
                    pending.append((s, query))
            else:
                s.finish = "length" if out.finish_reason == "length" else "eos"
        if pending:
            bodies = search_fn([q for _, q in pending])  # one batched call for the whole turn
            for (s, query), body in zip(pending, bodies):
                obs = observation_ids(tokenizer, body, cfg.max_obs_tokens)
                start = len(s.response_ids)
                s.response_ids += obs
                s.loss_mask += [0] * len(obs)  # retrieved tokens are never the policy's
                s.logprobs += [0.0] * len(obs)
                obs_text = tokenizer.decode(obs, skip_special_tokens=False)
                s.chunks.append({"role": "tool", "text": obs_text, "start": start, "end": len(s.response_ids)})
                s.tool_calls.append({"turn": turn, "query": query, "result": body})
    for s in states:
        s.finish = s.finish or "max_turns"
    return [_record(s, tokenizer) for s in states]


def _force_prefix(s: _State, segments: list[tuple[str, str]], tokenizer, cfg: RolloutConfig) -> None:
    for text, role in segments:
        ids, _ = tokenize_segments(tokenizer, [(text, role)], cfg.max_obs_tokens)
        start = len(s.response_ids)
        s.response_ids += ids
        s.loss_mask += [0] * len(ids)
        s.logprobs += [0.0] * len(ids)
        s.chunks.append({"role": "tool" if role == "obs" else "prefix", "text": tokenizer.decode(ids), "start": start,
                         "end": len(s.response_ids)})  # fmt: skip
        if role == "obs":
            s.tool_calls.append({"turn": 0, "query": last_block(s.chunks[-2]["text"], "search") or "", "result": text})


def _record(s: _State, tokenizer) -> dict:
    response_text = "".join(c["text"] for c in s.chunks)
    segments = []
    for c in s.chunks:
        segments += split_segments(c["text"], c["role"] == "policy")
    policy_text = "".join(c["text"] for c in s.chunks if c["role"] in ("policy", "prefix"))
    return {
        "question_id": s.question["id"],
        "group_id": s.group_id,
        "sample": s.sample,
        "question": s.question["question"],
        "golden_answers": s.question.get("golden_answers", []),
        "metadata": s.question.get("metadata", {}),
        "prompt_ids": s.prompt_ids,
        "response_ids": s.response_ids,
        "loss_mask": s.loss_mask,
        "logprobs": s.logprobs,
        "response_text": response_text,
        "chunks": s.chunks,
        "segments": segments,
        "tool_calls": s.tool_calls,
        "answer": last_block(policy_text, "answer") if s.finish == "answer" else None,
        "finish": s.finish,
        "turns": s.turns,
        "num_searches": len(s.tool_calls),
    }
