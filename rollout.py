"""Multi-turn search rollouts: one tool loop for every paper's agent protocol.

One call, `rollout_batch`, turns questions into rollout records (docs/design.md §2). The protocol
(`rollout.protocol`, agent/protocols.py: search_r1, bapo, deliberative, webfilter) decides the prompt,
the stop strings, how a turn's text becomes tool calls and how results are shown; the loop and
the token bookkeeping below are the same for all. Search-R1, the default:

    turn 1:  [prompt] -> policy writes "<think>..</think><search>Tavi Morek born</search>"
             (generation stops on the stop string `</search>`; vLLM never writes past it)
             the queries of the trajectories that stopped together go to the retriever in
             ONE batched call, and each trajectory's next turn is queued at once (continuous
             batching, rollout.continuous; turn by turn otherwise)
             "\\n<information>Doc 1(Title: Tavi Morek) ...</information>\\n" is appended
    turn 2:  policy writes "<think>..</think><answer>Velor</answer>" -> stop on `</answer>`
    up to max_turns turns may search, and one more may only answer (Search-R1's run_llm_loop:
    max_turns search turns, then a final generation with no search): a search there ends the
    rollout, unanswered. So a rollout searches at most max_turns times.
    with rollout.confidence_after_answer, an answering turn goes on to "<confidence> 3</confidence>".
    a malformed action (other protocols) gets an "invalid action" observation and costs a turn.

Prompts: a plain prompt for base models; with `rollout.chat_template` the tokenizer's own chat
template (instruct models), whose tool message carries WebFilter's observations.

`rollout.search_r1_text` (search_r1): Search-R1's exact text, to evaluate and train its released
checkpoints like for like: its make_prefix prompt verbatim on the question stripped + "?" (with
chat_template, that whole prompt is the one user message), `Doc i(Title: "t") text` hits in
"\n\n<information>..</information>\n\n", the first <search> / <answer> block of a turn decides, and a
turn with neither gets Search-R1's invalid-action text (loss_mask 0, no tags) and the rollout goes on
(agent/protocols.py SEARCH_R1_TEXT). An observation that fits max_obs_tokens is tokenised as one
string, as Search-R1 does; the policy's tokens are still kept as generated (Search-R1 decodes and
re-encodes them).

Token bookkeeping, the part the reference implementations get wrong (docs/design.md §7):
  * the policy's token ids are kept exactly as the engine generated them, never decoded and
    re-encoded; only the appended tool text is tokenised;
  * `loss_mask` is 1 on policy tokens and 0 on retrieved tokens (the prompt is not part of
    the response), so the loss never trains the model to predict what the search engine said
    (Search-R1 §3.1, "retrieved token masking");
  * `logprobs` are the engine's sampling log-probabilities (0.0 on tool tokens), used as
    log pi_old in the PPO ratio;
  * an observation is cut to `max_obs_tokens` *inside* its tags, so `</information>` (or the
    protocol's closing tag, or the chat template's end of the tool message) always survives.

Records are plain dicts that serialise to one JSON line; rewards.py and eval.py read only them.
search_r1's records are exactly what they were before protocols existed; the other protocols'
add "protocol", "num_reads", "confidence", "idk", "invalid_actions" ({"turn", "error"}), name
their tool_calls ({"turn", "name", "query" | "id", ["confidence"], "result"}), and, when the
observations are chat-template tool messages, "response": the transcript in the protocol's own
tags, which the rewards read instead of the template's markup.
"""

from __future__ import annotations

import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from agent import protocols
from agent.answers import last_block, parse_response, split_segments
from agent.protocols import SEARCH_R1_SYSTEM, Protocol, instructions, invalid_text
from trainer.config import ConfigError, RolloutConfig
from trainer.engine import Completion, Request

TAGS = [
    "<think>", "</think>", "<search>", "</search>",
    "<information>", "</information>", "<answer>", "</answer>",
]  # fmt: skip
STOP = protocols.PROTOCOLS["search_r1"].stop  # ["</search>", "</answer>"]
OBS_HEAD, OBS_TAIL = protocols.PROTOCOLS["search_r1"].obs  # "\n<information>", "</information>\n"
SEARCH_R1_TEMPLATE = SEARCH_R1_SYSTEM + " Question: {question}\n"


def render_prompt(question: str, template: str = "", cfg: RolloutConfig | None = None) -> str:
    """The plain (base-model) prompt for one question; `template` has a {question} slot; empty:
    the protocol's instructions (cfg.protocol, Search-R1's without a cfg) and the question, or
    with cfg.search_r1_text Search-R1's own prompt (its make_prefix, agent/protocols.py)."""
    if template:
        return template.format(question=question.strip())
    cfg = cfg or RolloutConfig()
    proto = protocols.for_config(cfg)
    if proto.prompt is not None:  # Search-R1's own (rollout.search_r1_text)
        return proto.prompt(question)
    return instructions(proto, cfg) + f" Question: {question.strip()}\n"


def check_chat_template(tokenizer, cfg: RolloutConfig, model_dir: str | Path) -> None:
    """rollout.chat_template needs a tokenizer that has one: refused in one line before any engine
    starts (a base model's tokenizer has none; transformers would fail at the first prompt)."""
    if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"rollout.chat_template is on, but the tokenizer in {model_dir} has no chat template "
                          "(tokenizer_config.json / chat_template.jinja): set rollout.chat_template: false for a "
                          "base model, or point model.path at an instruct model")  # fmt: skip


def prompt_ids(tokenizer, question: str, cfg: RolloutConfig, proto: Protocol) -> list[int]:
    """Base models: the plain prompt. Instruct models (cfg.chat_template): their own chat
    template, the instructions as system message (or prompt_template as the user message; or,
    with cfg.search_r1_text, Search-R1's whole prompt as the one user message, as its data
    scripts store it and verl's rl_dataset applies the template, add_generation_prompt=True)."""
    if not cfg.chat_template:
        return tokenizer.encode(render_prompt(question, cfg.prompt_template, cfg), add_special_tokens=False)
    if cfg.prompt_template or cfg.search_r1_text:
        messages = [{"role": "user", "content": render_prompt(question, cfg.prompt_template, cfg)}]
    else:
        messages = [
            {"role": "system", "content": instructions(proto, cfg)},
            {"role": "user", "content": question.strip()},
        ]
    text = tokenizer.apply_chat_template(
        messages, tools=proto.tools or None, tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def tool_message_wrap(tokenizer, proto: Protocol) -> tuple[str, str]:
    """(head, tail) of a tool message in the tokenizer's chat template: what closes the policy's
    turn and opens the tool's before the result, and what closes it and reopens the policy's."""
    mark_a, mark_b = "@@policy-turn@@", "@@tool-result@@"
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark_a},
                {"role": "tool", "content": mark_b}]  # fmt: skip
    text = tokenizer.apply_chat_template(
        messages, tools=proto.tools or None, tokenize=False, add_generation_prompt=True
    )
    a, b = text.find(mark_a), text.find(mark_b)
    if a < 0 or b < a:
        raise ValueError("this chat template cannot render a tool message; set rollout.chat_template: false")
    return text[a + len(mark_a) : b], text[b + len(mark_b) :]


def observation_ids(tokenizer, body: str, max_tokens: int, wrap: tuple[str, str] = (OBS_HEAD, OBS_TAIL),
                    whole: bool = False) -> list[int]:  # fmt: skip
    """`\\n<information>body</information>\\n` (or another (head, tail)) as token ids, the body cut
    to max_tokens: the closing tag is never cut. whole (rollout.search_r1_text): a body that fits is
    tokenised with its head and tail as one string, as Search-R1 tokenises its observation
    (generation.py, _process_next_obs), so that no token differs where they meet (".</")."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    ids = enc(body)
    if whole and len(ids) <= max_tokens:
        return enc(wrap[0] + body + wrap[1])
    return enc(wrap[0]) + ids[:max_tokens] + enc(wrap[1])


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
    invalid: list[dict] = field(default_factory=list)  # {"turn", "error"}: malformed actions
    finish: str = ""
    turns: int = 0
    # rollout_tree.py's branches: (first turn, sample) pairs, the sample whose seeds turns from that
    # one on draw with; empty: s.sample's all along (a chain)
    lineage: list[tuple[int, int]] = field(default_factory=list)


def _seed_sample(s: _State, turn: int) -> int:
    """The sample id in the seed of s's turn `turn`: a branch's turns up to its node are its
    parent's (copied, with their seeds), the ones after it its own."""
    return max([(t, k) for t, k in s.lineage if t <= turn], default=(0, s.sample))[1]


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

    search_fn(list[str]) -> list[str]: rendered hits for each query, one batched call for the
    trajectories that stopped together; or a dict of such batched tools, {"search": .., "read": ..}
    (search.tools.web_tools), whose results may be search/web.py dicts (the protocol renders them).
    Group ids are `group_prefix + question id`, so ids from several datasets cannot collide as
    long as question ids are unique within a dataset and the prefix names the dataset.

    Scheduling (`rollout.continuous`): with vLLM each trajectory's next turn is queued as soon as
    its own tool call returns (engine.run_continuous); otherwise turn by turn (run_in_turns). Every
    request carries its own seed (question, sample, turn), so the records do not depend on which
    trajectories shared a batch.
    """
    proto = protocols.for_config(cfg)  # rollout.protocol's, or Search-R1's exact text (search_r1_text)
    states = []
    for qi, q in enumerate(questions):
        ids = prompt_ids(tokenizer, q["question"], cfg, proto)
        for k in range(group_size):
            states.append(_State(q, group_prefix + str(q["id"]), k, ids))
            if prefixes is not None:
                _force_prefix(states[-1], prefixes[qi], tokenizer, cfg, proto)
    run_states(engine, tokenizer, states, search_fn, cfg, greedy, seed)
    return [_record(s, tokenizer, proto) for s in states]


def run_states(engine, tokenizer, states: list[_State], search_fn, cfg: RolloutConfig, greedy: bool = False,
               seed: int = 0) -> None:  # fmt: skip
    """The tool loop over `states` until each has finished: fresh ones (a prompt only) or ones that
    already hold some turns (rollout_tree.py's branches, copies of a node's state), which go on
    from their last observation. Each state's `finish` is set."""
    proto = protocols.for_config(cfg)
    tools = search_fn if isinstance(search_fn, dict) else {"search": search_fn}
    if hasattr(engine, "share_tool"):  # a tensor-parallel group's ranks: one call, shared (engine.share_tool)
        tools = {name: engine.share_tool(fn) for name, fn in tools.items()}
    # where an observation goes: inline in the protocol's tags, or a chat-template tool message
    wrap = tool_message_wrap(tokenizer, proto) if cfg.chat_template and proto.tool_message else proto.obs

    def take(done: list[tuple[Request, Completion]]) -> tuple[list[Request], list[tuple[int, dict]]]:
        """Finished generations -> the next requests of those that need no tool, and the tool
        calls of the others ((trajectory, action) pairs)."""
        pending: list[tuple[int, dict]] = []
        follow: list[Request] = []
        for req, out in done:
            s = states[req.key]
            if req.stop == CONFIDENCE_STOP:
                _append_confidence(s, out, tokenizer)
                continue
            act = _take_turn(s, out, tokenizer, proto, cfg)
            if act is not None:
                pending.append((req.key, act))
            elif s.finish == "answer" and cfg.confidence_after_answer:
                follow += _confidence_request(req.key, s, cfg, seed)
        return follow, pending

    def observe(pending: list[tuple[int, dict]], results: list[list]) -> list[Request]:
        """The tool results appended to their trajectories -> their next turns."""
        follow: list[Request] = []
        for (i, act), res in zip(pending, results):
            _append_observation(states[i], act, res, tokenizer, proto, tools, wrap, cfg)
            follow += _next_turn(states, i, cfg, proto, seed)
        return follow

    def on_done(done: list[tuple[Request, Completion]]) -> list[Request]:
        """Finished generations -> their tool calls, run in one batched call -> the next requests."""
        follow, pending = take(done)
        if pending:
            follow += observe(pending, _run_tools(tools, [act for _, act in pending]))  # one call per tool
        return follow

    first = [r for i in range(len(states)) for r in _next_turn(states, i, cfg, proto, seed)]
    sampling = {"temperature": 0.0 if greedy else cfg.temperature, "top_p": 1.0 if greedy else cfg.top_p}
    beside = cfg.tool_workers > 0 and getattr(engine, "tp", 1) == 1  # a TP group's shared call stays in step
    if cfg.continuous and hasattr(engine, "run_continuous") and beside:
        with ThreadPoolExecutor(cfg.tool_workers, thread_name_prefix="tools") as pool:

            def on_done_beside(done: list[tuple[Request, Completion]]) -> tuple[list[Request], list[Future]]:
                """As on_done, but the tool call runs in the pool while the engine decodes the rest;
                its results are appended (tokenised) back in the engine's thread (observe)."""
                follow, pending = take(done)
                acts = [act for _, act in pending]
                return follow, [pool.submit(lambda: partial(observe, pending, _run_tools(tools, acts)))] * bool(pending)

            engine.run_continuous(first, on_done_beside, **sampling)
    elif cfg.continuous and hasattr(engine, "run_continuous"):
        engine.run_continuous(first, on_done, **sampling)
    else:
        run_in_turns(engine, first, on_done, **sampling)
    for s in states:
        s.finish = s.finish or "max_turns"


def _next_turn(states: list[_State], i: int, cfg: RolloutConfig, proto: Protocol, seed: int) -> list[Request]:
    """The request for state i's next turn, or none when it has no turn or room left."""
    s, turn = states[i], states[i].turns + 1
    room = cfg.max_model_len - len(s.prompt_ids) - len(s.response_ids)
    if turn > cfg.max_turns + 1:  # max_turns that may search, then the answer-only one
        s.finish = s.finish or "max_turns"
    elif room < 8:
        s.finish = "length"
    else:
        # stable per-rollout seeds (not Python's salted hash): a resumed run samples the same
        key = zlib.crc32(f"{seed}|{s.group_id}|{_seed_sample(s, turn)}|{turn}".encode())
        return [Request(i, s.prompt_ids + s.response_ids, min(cfg.max_tokens_per_turn, room), key, proto.stop)]
    return []


def run_in_turns(engine, requests: list[Request], on_done, temperature: float, top_p: float) -> None:
    """Lock-step scheduling for engines that only offer `generate` (transformers, the teachers):
    every queued request in one batch (one per stop list), wait for all, hand them to on_done."""
    while requests:
        done: list[tuple[Request, Completion]] = []
        for stop in dict.fromkeys(tuple(r.stop) for r in requests):
            batch = [r for r in requests if tuple(r.stop) == stop]
            outs = engine.generate([r.prompt for r in batch], max_tokens=[r.max_tokens for r in batch],
                                   temperature=temperature, top_p=top_p, stop=list(stop),
                                   seeds=[r.seed for r in batch])  # fmt: skip
            done += zip(batch, outs)
        requests = on_done(done)


def _take_turn(s: _State, out: Completion, tokenizer, proto: Protocol, cfg: RolloutConfig) -> dict | None:
    """Append one generated turn to s; returns its tool action, or None when the rollout ends."""
    s.turns += 1
    start = len(s.response_ids)
    s.response_ids += out.token_ids
    s.loss_mask += [1] * len(out.token_ids)
    s.logprobs += out.logprobs
    text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
    s.chunks.append({"role": "policy", "text": text, "start": start, "end": len(s.response_ids)})
    act = proto.parse(text, cfg)  # {"kind": "answer" | "act" | "none", "calls", "error"}
    if act["kind"] == "answer":
        s.finish = "answer"
    elif act["kind"] == "act":
        if s.turns > cfg.max_turns:
            s.finish = "max_turns"  # the final turn may not search
        elif act.get("end"):
            s.finish = act["end"]  # search_r1: a closing tag without a block ("format")
        else:
            return act
    else:
        s.finish = "length" if out.finish_reason == "length" else "eos"
    return None


def _append_observation(s: _State, act: dict, results: list, tokenizer, proto: Protocol, tools: dict,
                        wrap: tuple[str, str], cfg: RolloutConfig) -> None:  # fmt: skip
    body = _observe(s, proto, act, results, tools, s.turns)
    if act.get("error") and proto.invalid_obs:  # Search-R1's invalid-action text: verbatim, no tags
        wrap = ("", "")
    obs = observation_ids(tokenizer, body, cfg.max_obs_tokens, wrap, whole=proto.whole_obs)
    start = len(s.response_ids)
    s.response_ids += obs
    s.loss_mask += [0] * len(obs)  # retrieved tokens are never the policy's
    s.logprobs += [0.0] * len(obs)
    obs_text = tokenizer.decode(obs, skip_special_tokens=False)
    s.chunks.append({"role": "tool", "text": obs_text, "start": start, "end": len(s.response_ids)})
    if wrap != proto.obs:  # a chat tool message: the rewards read the protocol's own tags
        cut = tokenizer.decode(tokenizer.encode(body, add_special_tokens=False)[: cfg.max_obs_tokens])
        s.chunks[-1]["block"] = proto.obs[0] + cut + proto.obs[1]


CONFIDENCE_STOP = ["</confidence>"]


def _confidence_request(i: int, s: _State, cfg: RolloutConfig, seed: int) -> list[Request]:
    """rollout.confidence_after_answer: the answering turn goes on until </confidence>.

    The continuation is the policy's own (loss_mask 1, its logprobs), part of the same turn and
    chunk: "<answer> Velor</answer>" becomes "<answer> Velor</answer><confidence> 3</confidence>".
    A rollout without room for it keeps its answer; the reward then finds no confidence.
    """
    room = cfg.max_model_len - len(s.prompt_ids) - len(s.response_ids)
    if room < 1:
        return []
    key = zlib.crc32(f"{seed}|{s.group_id}|{_seed_sample(s, s.turns)}|{s.turns}|confidence".encode())
    return [Request(i, s.prompt_ids + s.response_ids, min(cfg.max_tokens_per_turn, room), key, CONFIDENCE_STOP)]


def _append_confidence(s: _State, out: Completion, tokenizer) -> None:
    s.response_ids += out.token_ids
    s.loss_mask += [1] * len(out.token_ids)
    s.logprobs += out.logprobs
    s.chunks[-1]["text"] += tokenizer.decode(out.token_ids, skip_special_tokens=False)
    s.chunks[-1]["end"] = len(s.response_ids)


def _run_tools(tools: dict, acts: list[dict]) -> list[list]:
    """Every call of the turn, one batched call per tool: acts -> per act, its calls' results."""
    by_name: dict[str, list[dict]] = {}
    for act in acts:
        for call in act["calls"]:
            by_name.setdefault(call.get("name", "search"), []).append(call)
    found = {}
    for name, calls in by_name.items():
        if name in tools:
            for call, result in zip(calls, tools[name]([c.get("query", c.get("id")) for c in calls])):
                found[id(call)] = result
    return [[found.get(id(call)) for call in act["calls"]] for act in acts]


def _observe(s: _State, proto: Protocol, act: dict, results: list, tools: dict, turn: int) -> str:
    """The observation body of one turn's action; logs the calls and the invalid actions."""
    if act.get("error"):
        s.invalid.append({"turn": turn, "error": act["error"]})
        return invalid_text(proto, act["error"])
    pieces = [act["note"]] if act.get("note") else []
    for call, result in zip(act["calls"], results):
        name = call.get("name", "search")
        text, error = proto.show(call, result) if name in tools else ("", f"the {name} tool is not available")
        if error:
            s.invalid.append({"turn": turn, "error": error})
            pieces.append(invalid_text(proto, error))
        else:
            s.tool_calls.append({"turn": turn, **call, "result": text})
            pieces.append(text)
    return "\n".join(pieces)


def _force_prefix(s: _State, segments: list[tuple[str, str]], tokenizer, cfg: RolloutConfig, proto: Protocol) -> None:
    for text, role in segments:
        if role == "obs":  # a forced search's hits, shown and wrapped as the protocol shows a search's
            text = proto.show({"query": ""}, text)[0]
            ids = observation_ids(tokenizer, text, cfg.max_obs_tokens, proto.obs, whole=proto.whole_obs)
        else:
            ids = tokenizer.encode(text, add_special_tokens=False)
        start = len(s.response_ids)
        s.response_ids += ids
        s.loss_mask += [0] * len(ids)
        s.logprobs += [0.0] * len(ids)
        s.chunks.append({"role": "tool" if role == "obs" else "prefix", "text": tokenizer.decode(ids), "start": start,
                         "end": len(s.response_ids)})  # fmt: skip
        if role == "obs":
            s.tool_calls.append({"turn": 0, "query": last_block(s.chunks[-2]["text"], "search") or "", "result": text})


def _record(s: _State, tokenizer, proto: Protocol | None = None) -> dict:
    response_text = "".join(c["text"] for c in s.chunks)
    segments = []
    for c in s.chunks:
        segments += split_segments(c["text"], c["role"] == "policy")
    policy_text = "".join(c["text"] for c in s.chunks if c["role"] in ("policy", "prefix"))
    record = {
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
    if proto is not None and proto.invalid_obs:  # Search-R1's text: turns with no <search> / <answer> block
        record["invalid_actions"] = s.invalid
    if proto is None or proto.name == "search_r1":
        return record  # Search-R1's record, exactly as before protocols existed
    if any("block" in c for c in s.chunks):  # chat tool messages: the transcript in the protocol's tags
        record["response"] = "".join(c.get("block", c["text"]) for c in s.chunks)
    p = parse_response(record.get("response", response_text))  # the rewards' parser (agent/answers.py)
    answered = s.finish == "answer"
    record.update({
        "num_searches": sum(c.get("name", "search") == "search" for c in s.tool_calls),
        "num_reads": sum(c.get("name") == "read" for c in s.tool_calls),
        "protocol": proto.name,
        "answer": p.answer if answered else None,
        "confidence": p.confidence,
        "idk": answered and p.idk,
        "invalid_actions": s.invalid,
    })  # fmt: skip
    return record
