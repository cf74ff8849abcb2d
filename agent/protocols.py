"""Agent protocols: how the policy acts and what comes back, one table (`PROTOCOLS`).

`rollout.protocol` picks one; rollout.py runs the same loop for all of them. A protocol is a
plain record of

    system   the instructions, in our own words after the paper (never its text, but for
             rollout.search_r1_text below, copied with attribution); the plain
             prompt is `system + " Question: <question>\\n"`. With `rollout.chat_template` the
             model's own chat template gets them as the system message, the question as the user
             message (and `tools`, the tool schemas, for JSON tool calling)
    stop     stop strings: a turn ends right after an action or an answer (docs/design.md §7)
    parse    one policy turn's text -> {"kind": "answer"} | {"kind": "none"} (no action: the
             rollout ends) | {"kind": "act", "calls": [..], "error": why it is invalid, "note": ..}
    show     (call, tool result) -> (text the policy sees, error or None)
    obs      (head, tail) around an observation; rollout.py cuts only the body between them, so
             the closing tag survives truncation. `tool_message`: with a chat template the
             observation is a tool message of the model's template instead (webfilter)
    hint     what a valid action looks like, for the invalid-action observation
    idk      the reliable-prompt sentence added with `rollout.allow_idk` (BAPO §3.2)
    invalid_obs  the invalid-action observation verbatim, outside the obs tags (empty: `hint`'s)
    prompt   the whole plain prompt of a question (None: `system + " Question: <question>\\n"`)
    whole_obs    an observation that fits is tokenised with its tags as one string (Search-R1 does)
    tokens, web_tools, query_sep, idk_answer, teach: what the rest reads from this one table (tiny
             tokenizer tags, search.tools' web tools, the rewards' query split, the tiny teacher), so a
             protocol registers with one entry here (tests/test_fork.py checks no other file lists them)

    protocol      the policy writes                                   and gets back
    search_r1     <search> q </search>                                <information> Doc i(Title: t) text </information>
    bapo          <search> q </search>, <answer> .. \\boxed{a} </answer> <result> .. </result>
    deliberative  <confidence> n </confidence> each step, then        <result> [id] title per source </result>
                  <search> q </search> | <read> id </read> | <answer>   <result> [id] title, the source's text </result>
    webfilter     <tool_call>{"name": "search", "arguments":          <tool_response> [i] title | url | date,
                  {"queries": ["q1", "q2"]}}</tool_call>                 snippet </tool_response> (a tool message)

A malformed action (not JSON, unknown tool, empty search or read, a read of a missing id, a step
confidence outside 1-10, BAPO's answer without one well-formed \\boxed{}) gets an "invalid
action" observation and costs its turn; it never raises. search_r1 keeps Search-R1's loop
exactly as before: a closing </search> without a block ends the rollout (finish "format").

`rollout.search_r1_text` (search_r1 only) swaps in Search-R1's exact text (SEARCH_R1_TEXT below, copied
from its code): make_prefix's prompt on the question stripped + "?", `Doc i(Title: "t") text` hits in
"\n\n<information>..</information>\n\n", the first <search> / <answer> block of a turn decides, and
a turn with neither gets Search-R1's invalid-action text (no tags) and the rollout goes on.

Calls are dicts: {"name": "search", "query": q} or {"name": "read", "id": x} (search_r1's are
{"query": q}: its tool log predates the names; report/metrics.py counts a nameless entry as a search).
Parsing goes through agent/answers.py, the parser the rewards use, so it is written once.
The format check (answers._structure_ok) accepts a <confidence> after any think (deliberative's
step confidences) and on the final answer; the reward reads the final answer's
(tests/test_protocols.py: test_deliberative_reward_accepts_step_confidences).

Tools (rollout_batch's `search_fn`): a batched callable (queries -> results), or a dict of them,
{"search": .., "read": ..}; `web_tools` builds both on search/web.py. A result is text, or a
search/web.py dict ({"results": [..]} / {"title", "text"} / {"error": ..}) that `show` renders.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.answers import boxed, confidence_value, last_block, load_tool_call, tool_call_queries
from search.web import format_web_results
from trainer.config import PROTOCOLS as TABLE
from trainer.config import ConfigError, RolloutConfig

# Our own wording of Search-R1's instruction (docs/design.md §3): think, search when knowledge is
# missing, read the information, answer briefly. rollout.SEARCH_R1_TEMPLATE is this + the question.
SEARCH_R1_SYSTEM = (
    "Answer the question. Reason inside <think> and </think> every time you get new "
    "information. If some knowledge is missing, search for it with <search> query </search>; "
    "the top results come back between <information> and </information>. You may search "
    "as often as you like. When you know the answer, write it inside <answer> and </answer> "
    "with no explanation, for example <answer> Paris </answer>."
)

# rollout.search_r1_text: Search-R1's own text, copied verbatim from PeterGriffinJin/Search-R1 at commit
# a14dc3a4ffc6fe88c1e95038d9738e21ba3f7a06 (Apache License 2.0; Copyright 2024 Bytedance Ltd. and/or its
# affiliates, and the Search-R1 authors). The prompt is make_prefix(dp, template_type='base') of
# scripts/data_process/nq_search.py, qa_search_train_merge.py and qa_search_test_merge.py (the same
# string in the three, and in infer.py), its backslash-continued lines joined as Python joins them;
# "as your want" is theirs. {question} is the question as those scripts store it (search_r1_question).
SEARCH_R1_PREFIX = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
# search_r1/llm_agent/generation.py, execute_predictions: what a turn with no <search> / <answer> block
# gets (the rollout goes on), and the observation of a search, f'\n\n<information>{search_results.strip()}
# </information>\n\n' (search_results: _passages2string, search/corpus.py format_hits_search_r1)
SEARCH_R1_INVALID = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"
)
SEARCH_R1_OBS = ("\n\n<information>", "</information>\n\n")


def search_r1_question(question: str) -> str:
    """The question as Search-R1's data scripts store it: stripped, "?" appended unless it ends with one."""
    question = question.strip()
    return question if question.endswith("?") else question + "?"


def search_r1_prompt(question: str) -> str:
    """Search-R1's plain prompt for one question (its make_prefix on its stored question)."""
    return SEARCH_R1_PREFIX.format(question=search_r1_question(question))


# BAPO App. C.1 (TIR prompt), our wording: think / search / result tags, the exact answer boxed.
BAPO_SYSTEM = (
    "You solve questions step by step and can look facts up with a Wikipedia search tool. "
    "Write your reasoning between <think> and </think> before every action. To look something "
    "up, put a query between <search> and </search>; what the tool finds comes back between "
    "<result> and </result>. Finish with the answer between <answer> and </answer>, its last "
    "part being the exact final answer inside \\boxed{}, for example "
    "<answer> So it is \\boxed{Paris} </answer>."
)

# Deliberative Searcher §2.2, our wording: THINK / SEARCH / READ, a 1-10 confidence on every step.
DELIBERATIVE_SYSTEM = (
    "Answer the question carefully and say how sure you are at every step. A step is your "
    "reasoning between <think> and </think>, then how likely you are to answer correctly now, "
    "a whole number from 1 (a guess) to 10 (certain), between <confidence> and </confidence>, "
    "then one action: <search> query </search> lists matching sources as [id] title lines; "
    "<read> id </read> returns the text of one source by its id; <answer> answer </answer> "
    "ends, with no explanation. Tool output comes back between <result> and </result>. "
    "Search and read when you are unsure, and revise your confidence after what you find. "
    "A last step looks like <think> the source says Paris </think><confidence> 8 </confidence>"
    "<answer> Paris </answer>."
)

# WebFilter §3.2, our wording: JSON tool calls, advanced operators, distrust of unreliable pages.
WEBFILTER_SYSTEM = (
    "Answer the question with the help of a web search tool. The web also holds pages that are "
    "wrong, so prefer sources you can trust. Reason between <think> and </think> before every "
    "action. To search, write one JSON object between <tool_call> and </tool_call>: "
    '{"name": "search", "arguments": {"queries": ["a query", "another query"]}}, with at most '
    "{max_queries} queries per call. A query may use operators: site:domain or -site:domain to "
    'keep or drop a source, "an exact phrase", -word, AND / OR / NOT in capitals, '
    "before:YYYY-MM-DD and after:YYYY-MM-DD. Each result comes back between <tool_response> and "
    "</tool_response> with its title, url, date and a snippet. Search no more than you need. "
    "Give the final answer between <answer> and </answer> with no explanation, for example "
    "<answer> Paris </answer>."
)

SEARCH_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Web search with operators (site:, -site:, before:, after:, quotes, AND / OR / NOT, -word).",
        "parameters": {
            "type": "object",
            "properties": {"queries": {"type": "array", "items": {"type": "string"}, "description": "search queries"}},
            "required": ["queries"],
        },
    },
}


@dataclass(frozen=True)
class Protocol:
    name: str
    system: str
    stop: list[str]
    parse: Callable[[str, RolloutConfig], dict]
    show: Callable[[dict, object], tuple[str, str | None]]
    obs: tuple[str, str]
    hint: str = ""
    idk: str = ""
    tool_message: bool = False
    tools: list[dict] = field(default_factory=list)
    invalid_obs: str = ""  # the invalid-action observation verbatim, outside the obs tags (Search-R1's text)
    prompt: Callable[[str], str] | None = None  # the whole plain prompt of a question (None: system + question)
    whole_obs: bool = False  # an observation that fits is tokenised with its tags as one string (Search-R1's)
    # what the rest of the project reads from the table (nothing else lists the protocols):
    tokens: tuple[str, ...] = ()  # its own tags, whole tokens of the tiny tokenizer (tiny/sft.py), after Search-R1's
    web_tools: bool = False  # its tools: search/web.py's search and read (search.tools), in process only
    query_sep: str = ""  # splits one <search> block into queries (answers.parse_response); "": one query
    idk_answer: str = "I don't know"  # the tiny teacher's "I don't know" answer (tiny/teachers.py)
    # the tiny teacher's turn (think, action, arg, confidence, confidence after the answer) -> text;
    # None: tiny/teachers.render's (Search-R1's tags, or the papers' formats)
    teach: Callable[[str, str, str, int | None, bool], str] | None = None


def invalid(why: str) -> dict:
    return {"kind": "act", "calls": [], "error": why}


def _ends(text: str, tag: str) -> bool:
    return text.rstrip().endswith(f"</{tag}>")


# ------------------------------------------------------------------------------- parse a turn


def parse_search_r1(text: str, cfg: RolloutConfig) -> dict:
    """Search-R1's loop as it always was: an empty query is searched, a bare </search> ends."""
    if _ends(text, "answer"):
        return {"kind": "answer"}
    if _ends(text, "search"):
        query = last_block(text, "search")
        return (
            {"kind": "act", "calls": [], "end": "format"}
            if query is None
            else {"kind": "act", "calls": [{"query": query}]}
        )
    return {"kind": "none"}


_SEARCH_R1_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)  # generation.py's pattern


def parse_search_r1_text(text: str, cfg: RolloutConfig) -> dict:
    """Search-R1's postprocess_predictions (generation.py): the turn's first <search> / <answer> block
    decides, the query stripped; a turn with neither (an EOS, a cut turn, a bare </search>) is invalid and
    gets SEARCH_R1_INVALID, and the rollout goes on, as in Search-R1's run_llm_loop."""
    match = _SEARCH_R1_ACTION.search(text)
    if match is None:
        return invalid("no <search> or <answer> block")
    if match.group(1) == "answer":
        return {"kind": "answer"}
    return {"kind": "act", "calls": [{"query": match.group(2).strip()}]}


def parse_bapo(text: str, cfg: RolloutConfig) -> dict:
    if _ends(text, "answer"):
        if not boxed(last_block(text, "answer") or ""):
            return invalid("the answer needs the final answer inside one \\boxed{}, not nested and not empty")
        return {"kind": "answer"}
    if _ends(text, "search"):
        query = last_block(text, "search")
        return {"kind": "act", "calls": [{"name": "search", "query": query}]} if query else invalid("empty search")
    return {"kind": "none"}


def parse_deliberative(text: str, cfg: RolloutConfig) -> dict:
    if _ends(text, "answer"):  # a final confidence outside 1-10 is a format failure in the reward
        return {"kind": "answer"}
    for tag, key in (("search", "query"), ("read", "id")):
        if _ends(text, tag):
            raw = last_block(text, "confidence")
            if raw is not None and confidence_value(raw) is None:
                return invalid(f"the confidence must be a whole number from 1 to 10, not {raw[:20]!r}")
            arg = last_block(text, tag)
            if not arg:
                return invalid(f"empty or unopened <{tag}> block")
            conf = {} if raw is None else {"confidence": confidence_value(raw)}
            return {"kind": "act", "calls": [{"name": tag, key: arg, **conf}]}
    return {"kind": "none"}


def parse_webfilter(text: str, cfg: RolloutConfig) -> dict:
    if _ends(text, "answer"):
        return {"kind": "answer"}
    if not _ends(text, "tool_call"):
        return {"kind": "none"}
    body = last_block(text, "tool_call")
    call = load_tool_call(body) if body is not None else None
    if call is None:
        return invalid('the tool call is not JSON like {"name": "search", "arguments": {"queries": [..]}}')
    if call.get("name") != "search":
        return invalid(f"unknown tool {str(call.get('name'))[:40]!r}; the only tool is search")
    queries = tool_call_queries(body)
    if not queries or not all(q.strip() for q in queries):
        return invalid("arguments.queries must be a list of non-empty strings")
    n = cfg.max_queries_per_call
    note = f"(only the first {n} of {len(queries)} queries were run)" if len(queries) > n else ""
    return {"kind": "act", "calls": [{"name": "search", "query": q.strip()} for q in queries[:n]], "note": note}


# --------------------------------------------------------------------- show one tool's result


def _error(result) -> str | None:
    return result.get("error") if isinstance(result, dict) else None


def show_text(call: dict, result) -> tuple[str, str | None]:
    """Search-R1 / BAPO: the search tool's rendered hits, as given."""
    return (result if isinstance(result, str) else str(result)), None


def show_search_r1_text(call: dict, result) -> tuple[str, str | None]:
    """Search-R1's exact text: the rendered hits stripped, as its information block holds them."""
    return (result if isinstance(result, str) else str(result)).strip(), None


def show_deliberative(call: dict, result) -> tuple[str, str | None]:
    """SEARCH lists sources ([id] title), READ shows one; a read of a missing id is invalid."""
    if not isinstance(result, dict):  # a tool that renders its own text (e.g. Search-R1's hits)
        return str(result), None
    if _error(result):
        return "", f"{call['name']} failed: {result['error']}"
    if call["name"] == "read":
        return f"[{result.get('id', call['id'])}] {result.get('title', '')}\n{result.get('text', '')}", None
    sources = [f"[{r['id']}] {r.get('title', '')}" for r in result.get("results", [])]
    return "\n".join(sources) or "No sources found.", None


def show_web(call: dict, result) -> tuple[str, str | None]:
    """WebFilter: each query's results as title | url | date and a snippet (search/web.py's format)."""
    if isinstance(result, str):
        text = result
    elif not isinstance(result, dict) or "results" not in result:
        text = str(result)
    else:
        text = format_web_results({"error": result.get("error"), "results": result["results"]})
    return f"Results for {call['query']}:\n{text}", None


# ------------------------------------------------------------------------------------ table

# One entry registers a protocol: rollout.protocol's choices (trainer/config.py), the rewards' parser, the
# tiny teacher and its tokenizer, and the world's cache key (tiny/world.py) all read it from this table.
PROTOCOLS: dict[str, Protocol] = TABLE  # the one dict trainer/config.py checks rollout.protocol against
PROTOCOLS |= {
    "search_r1": Protocol(
        "search_r1", SEARCH_R1_SYSTEM, ["</search>", "</answer>"], parse_search_r1, show_text,
        ("\n<information>", "</information>\n"),
        hint="Search with <search> query </search> or answer with <answer> answer </answer>.",
        idk=" If you cannot find the answer, answer I don't know.",
    ),
    "bapo": Protocol(
        "bapo", BAPO_SYSTEM, ["</search>", "</answer>"], parse_bapo, show_text, ("\n<result>", "</result>\n"),
        hint="Search with <search> query </search> or answer with <answer> .. \\boxed{answer} </answer>.",
        idk=" If your reasoning and searches cannot settle the question, answer \\boxed{I DON'T KNOW}.",
        tokens=("<result>", "</result>"), idk_answer="\\boxed{I DON'T KNOW}",
    ),
    "deliberative": Protocol(
        "deliberative", DELIBERATIVE_SYSTEM, ["</search>", "</read>", "</answer>"], parse_deliberative,
        show_deliberative, ("\n<result>", "</result>\n"),
        hint="Write <confidence> 1-10 </confidence>, then <search> query </search>, <read> id </read> (an id "
        "from the search results) or <answer> answer </answer>.",
        idk=" If you cannot find out, answer I don't know, with a low confidence.",
        tokens=("<result>", "</result>", "<read>", "</read>", "<confidence>", "</confidence>"), web_tools=True,
    ),
    "webfilter": Protocol(
        "webfilter", WEBFILTER_SYSTEM, ["</tool_call>", "</answer>"], parse_webfilter, show_web,
        ("\n<tool_response>\n", "\n</tool_response>\n"),
        hint='Call <tool_call>{"name": "search", "arguments": {"queries": ["..."]}}</tool_call> or answer with '
        "<answer> answer </answer>.",
        idk=" If the evidence is not enough to answer safely, answer I don't know.",
        tool_message=True, tools=[SEARCH_TOOL_SCHEMA],
        tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"), web_tools=True,
    ),
}  # fmt: skip

# rollout.search_r1_text: the search_r1 protocol in Search-R1's own text (its name, so its records stay
# search_r1's). `system` is the prompt's instruction part; rollout.py renders the prompt with search_r1_prompt.
SEARCH_R1_TEXT = Protocol(
    "search_r1", SEARCH_R1_PREFIX.split(" Question: {question}")[0], ["</search>", "</answer>"], parse_search_r1_text,
    show_search_r1_text, SEARCH_R1_OBS, invalid_obs=SEARCH_R1_INVALID, prompt=search_r1_prompt, whole_obs=True,
)  # fmt: skip


def get(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ConfigError(f"config key 'rollout.protocol' must be one of {', '.join(PROTOCOLS)}; got {name!r}")
    return PROTOCOLS[name]


def for_config(cfg: RolloutConfig) -> Protocol:
    """The protocol a rollout runs: `rollout.protocol`'s, or SEARCH_R1_TEXT with rollout.search_r1_text."""
    proto = get(cfg.protocol)
    if not cfg.search_r1_text:
        return proto
    if proto.name != "search_r1":
        raise ConfigError(f"config key 'rollout.search_r1_text' needs rollout.protocol search_r1; got {cfg.protocol!r}")
    return SEARCH_R1_TEXT


def invalid_text(proto: Protocol, why: str) -> str:
    """The invalid-action observation (our wording of the papers' "invalid action, try again"), or the
    protocol's own verbatim text (Search-R1's with rollout.search_r1_text)."""
    return proto.invalid_obs or f"Invalid action: {why}. {proto.hint} Try again."


def instructions(proto: Protocol, cfg: RolloutConfig) -> str:
    text = proto.system.replace("{max_queries}", str(cfg.max_queries_per_call))
    return text + (proto.idk if cfg.allow_idk else "")
