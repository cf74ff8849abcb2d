"""rollout.search_r1_text: Search-R1's exact text, checked against strings copied from its code.

The functions and strings marked "verbatim" below are copied from PeterGriffinJin/Search-R1 at commit
a14dc3a4ffc6fe88c1e95038d9738e21ba3f7a06 (Apache License 2.0; Copyright 2024 Bytedance Ltd. and/or its
affiliates), with trailing whitespace dropped and `self` removed:

    make_prefix, the question's processing   scripts/data_process/qa_search_test_merge.py (the same in
                                             qa_search_train_merge.py and nq_search.py)
    the chat template's use                  verl/utils/dataset/rl_dataset.py, RLHFDataset.__getitem__
    _passages2string, the information block, search_r1/llm_agent/generation.py
    the invalid-action text, postprocess_predictions

They are kept here as Search-R1 wrote them (its backslash-continued f-strings, its quotes), so that
agent/protocols.py's re-wrapped constants are checked against the original, not against themselves.
The index is a real BM25 index (search/index.py) over a small wiki-18 style corpus written here.
"""

import json
import re

import pytest

from agent import protocols
from agent.protocols import SEARCH_R1_INVALID, SEARCH_R1_PREFIX, SEARCH_R1_TEXT
from rollout import SEARCH_R1_TEMPLATE, prompt_ids, render_prompt, rollout_batch
from search.corpus import format_hits, format_hits_search_r1
from search.index import build_index, load_index, search
from search.tools import make_search_fn
from tiny.sft import qwen_style_bpe
from trainer.config import ConfigError, RolloutConfig, key_notes, load_config
from trainer.engine import Completion

# ------------------------------------------------------------ verbatim from Search-R1 (a14dc3a)


def make_prefix(dp, template_type):  # scripts/data_process/qa_search_test_merge.py
    question = dp['question']

    # NOTE: also need to change reward_score/countdown.py
    if template_type == 'base':
        """This works for any base model"""
        prefix = f"""Answer the given question. \
You must conduct reasoning inside <think> and </think> first every time you get new information. \
After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> and it will return the top searched results between <information> and </information>. \
You can search as many times as your want. \
If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"""  # noqa: E501
    else:
        raise NotImplementedError
    return prefix


def process_question(example):  # the first lines of process_fn, the same three scripts
    example['question'] = example['question'].strip()
    if example['question'][-1] != '?':
        example['question'] += '?'
    return example


def _passages2string(retrieval_result):  # search_r1/llm_agent/generation.py
    format_reference = ''
    for idx, doc_item in enumerate(retrieval_result):

        content = doc_item['document']['contents']
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        format_reference += f"Doc {idx+1}(Title: {title}) {text}\n"

    return format_reference


def information_block(search_results):  # generation.py, execute_predictions, action == 'search'
    return f'\n\n<information>{search_results.strip()}</information>\n\n'


# generation.py, execute_predictions, an invalid action
INVALID_OBS = f'\nMy previous action is invalid. \
If I want to search, I should put the query between <search> and </search>. \
If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n'  # noqa: E501, F541


def postprocess_predictions(predictions):  # generation.py, LLMGenerationManager.postprocess_predictions
    actions = []
    contents = []

    for prediction in predictions:
        if isinstance(prediction, str): # for llm output
            pattern = r'<(search|answer)>(.*?)</\1>'
            match = re.search(pattern, prediction, re.DOTALL)
            if match:
                content = match.group(2).strip()  # Return only the content inside the tags
                action = match.group(1)
            else:
                content = ''
                action = None
        else:
            raise ValueError(f"Invalid prediction type: {type(prediction)}")

        actions.append(action)
        contents.append(content)

    return actions, contents


# ---------------------------------------------------------------------------------- fixtures

QUESTION = "who got the first nobel prize in physics"  # FlashRAG nq (test): lower case, no "?"
# the prompt Search-R1's data scripts store for it, written out
PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: who got the first nobel prize in physics?\n"
)
# wiki-18's format (Search-R1's corpus): contents = the title in double quotes, a newline, the text
DOCS = [
    {"id": "1", "contents": '"Nobel Prize in Physics"\nThe Nobel Prize in Physics is a yearly award given by the '
     "Royal Swedish Academy of Sciences. The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad "
     "Röntgen."},
    {"id": "2", "contents": '"Wilhelm Röntgen"\nWilhelm Conrad Röntgen was a German physicist who discovered X-rays '
     "and received the first Nobel Prize in Physics, in 1901."},
    {"id": "3", "contents": '"Nobel Prize"\nThe Nobel Prizes are five separate prizes, first awarded in 1901: in '
     "physics, chemistry, medicine, literature and peace."},
    {"id": "4", "contents": '"Beijing"\nBeijing is the capital of the People\'s Republic of China.'},
    {"id": "5", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "6", "contents": '"Marie Curie"\nMarie Curie shared the 1903 Nobel Prize in Physics and won the 1911 '
     "Nobel Prize in Chemistry."},
]  # fmt: skip
# BM25's top 3 for QUESTION, as Search-R1's _passages2string renders them: the titles keep their quotes
HITS_TEXT = (
    'Doc 1(Title: "Wilhelm Röntgen") Wilhelm Conrad Röntgen was a German physicist who discovered X-rays and '
    "received the first Nobel Prize in Physics, in 1901.\n"
    'Doc 2(Title: "Nobel Prize in Physics") The Nobel Prize in Physics is a yearly award given by the Royal Swedish '
    "Academy of Sciences. The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen.\n"
    'Doc 3(Title: "Nobel Prize") The Nobel Prizes are five separate prizes, first awarded in 1901: in physics, '
    "chemistry, medicine, literature and peace.\n"
)

# Qwen2.5-Instruct's chat template for plain messages (its tool branches left out): a default system
# message when the conversation has none. What verl's rl_dataset renders for Search-R1's Qwen2.5 runs.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tok():
    """A tokenizer built as Qwen2.5's is: byte-level BPE behind Qwen2's split regex, the tags plain text
    (not whole tokens, unlike the tiny world's), <|im_start|> / <|im_end|> special, a chat template.
    Trained on Search-R1's text, it merges across the observation's seams (".<" of ".</information>"),
    so an observation tokenised in pieces would differ from Search-R1's, tokenised whole."""
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = qwen_style_bpe([PROMPT + TURN1 + information_block(HITS_TEXT) + TURN2 + INVALID_OBS] * 10, 500, special)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": special[1:]})
    tok.chat_template = QWEN_TEMPLATE
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    block = information_block(HITS_TEXT)
    assert enc(block) != enc("\n\n<information>") + enc(HITS_TEXT.strip()) + enc("</information>\n\n")
    return tok


@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    """(corpus path, bm25 index dir) of a small wiki-18 style corpus."""
    base = tmp_path_factory.mktemp("wiki")
    (base / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return base / "corpus.jsonl", build_index(base / "corpus.jsonl", base / "bm25")


def search_r1_cfg(wiki, *sets):
    return load_config(None, ["rollout.search_r1_text=true", f"retriever.index={wiki[1]}", "retriever.topk=3",
                              "rollout.max_obs_tokens=100000", "rollout.max_model_len=100000", *sets])  # fmt: skip


class Scripted:
    """The engine interface replaying `turns`, one a call (one trajectory): the policy's text at that turn."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.outputs = tok, list(turns), []

    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None):
        assert len(prompts) == 1
        ids = self.tok.encode(self.turns[len(self.outputs)], add_special_tokens=False)
        self.outputs.append(Completion(ids, [-0.001 * (i + 1) for i in range(len(ids))], "stop"))
        return self.outputs[-1:]


def check_bookkeeping(r, tok, engine):
    """loss_mask 1 exactly on the policy's tokens, kept as the engine generated them; 0 on the rest."""
    assert len(r["response_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
    policy = []
    for c in r["chunks"]:
        ids = r["response_ids"][c["start"] : c["end"]]
        assert tok.decode(ids) == c["text"]
        assert set(r["loss_mask"][c["start"] : c["end"]]) == {1 if c["role"] == "policy" else 0}
        policy += ids if c["role"] == "policy" else []
    assert policy == [i for out in engine.outputs for i in out.token_ids]
    logprobs = [lp for lp, m in zip(r["logprobs"], r["loss_mask"]) if m]
    assert logprobs == [lp for out in engine.outputs for lp in out.logprobs]


# ------------------------------------------------------------------------------------ prompt


def test_the_copied_constants_are_search_r1s():
    assert SEARCH_R1_PREFIX.format(question="{question}") == make_prefix({"question": "{question}"}, "base")
    assert SEARCH_R1_INVALID == INVALID_OBS
    assert SEARCH_R1_TEXT.obs == tuple(information_block("@").split("@"))


def test_plain_prompt_is_make_prefix_on_the_stored_question(tok):
    cfg = RolloutConfig(search_r1_text=True)
    expected = make_prefix(process_question({"question": QUESTION}), "base")
    assert expected == PROMPT
    assert render_prompt(QUESTION, cfg=cfg) == PROMPT
    assert render_prompt(f"  {QUESTION} \n", cfg=cfg) == PROMPT  # stripped, then "?"
    assert render_prompt("Where was Tavi Morek born? ", cfg=cfg).endswith("Question: Where was Tavi Morek born?\n")
    # no chat template: the prompt's text tokenised as verl does (add_special_tokens=False)
    ids = prompt_ids(tok, QUESTION, cfg, protocols.get("search_r1"))
    assert ids == tok(PROMPT, add_special_tokens=False)["input_ids"]
    # off (the default): our own wording, as before
    assert render_prompt(QUESTION) == SEARCH_R1_TEMPLATE.format(question=QUESTION)
    assert render_prompt(QUESTION, cfg=RolloutConfig()) == SEARCH_R1_TEMPLATE.format(question=QUESTION)


def test_chat_prompt_is_the_whole_prompt_as_the_one_user_message(tok):
    cfg = RolloutConfig(search_r1_text=True, chat_template=True)
    # Search-R1's parquet row: prompt=[{"role": "user", "content": make_prefix(...)}]; rl_dataset.py renders it
    chat = [{"role": "user", "content": make_prefix(process_question({"question": QUESTION}), "base")}]
    prompt_with_chat_template = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt_with_chat_template == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n" + PROMPT + "<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = prompt_ids(tok, QUESTION, cfg, protocols.get("search_r1"))
    assert ids == tok(prompt_with_chat_template, add_special_tokens=False)["input_ids"]  # verl_F.tokenize_and_...
    # off: our instruction as the system message, the question as the user message
    ours = tok.decode(prompt_ids(tok, QUESTION, RolloutConfig(chat_template=True), protocols.get("search_r1")))
    assert ours.startswith("<|im_start|>system\nAnswer the question. Reason inside")


# ------------------------------------------------------------------------------- observation


def test_hits_and_observation_are_rendered_as_search_r1_does(wiki):
    index = load_index(wiki[1])
    hits = search(index, [QUESTION + "?"], 3)[0]
    assert [h["document"]["id"] for h in hits] == ["2", "1", "3"]
    assert format_hits_search_r1(hits) == _passages2string(hits) == HITS_TEXT  # each line ends in "\n"
    assert format_hits_search_r1([]) == _passages2string([]) == ""
    # make_search_fn renders with it when the option is on (our index in process; a /retrieve server's
    # hits carry the same documents); off, our format_hits as before (no quotes, no last newline)
    assert make_search_fn(search_r1_cfg(wiki), wiki[0], {})([QUESTION + "?"]) == [HITS_TEXT]
    ours = make_search_fn(search_r1_cfg(wiki, "rollout.search_r1_text=false"), wiki[0], {})([QUESTION + "?"])
    assert ours == [format_hits(hits)] and ours[0].startswith("Doc 1(Title: Wilhelm Röntgen) Wilhelm")
    # the observation: the hits stripped, between Search-R1's newlines and tags
    head, tail = SEARCH_R1_TEXT.obs
    body, _ = SEARCH_R1_TEXT.show({"query": QUESTION}, HITS_TEXT)
    assert head + body + tail == information_block(_passages2string(hits)) == (
        "\n\n<information>" + HITS_TEXT[:-1] + "</information>\n\n")  # fmt: skip


# ---------------------------------------------------------------------------------- rollouts

TURN1 = "<think> I need to find who won the first Nobel Prize in Physics. </think>\n<search> first nobel prize physics </search>"  # noqa: E501
TURN2 = "<think> Doc 1 says Wilhelm Conrad Röntgen. </think>\n<answer> Wilhelm Conrad Röntgen </answer>"


def test_two_turn_rollout_shows_search_r1s_information_block(tok, wiki):
    cfg = search_r1_cfg(wiki)
    search_fn = make_search_fn(cfg, wiki[0], {})
    engine = Scripted(tok, [TURN1, TURN2])
    question = {"id": "nq-1", "question": QUESTION, "golden_answers": ["Wilhelm Conrad Röntgen"]}
    (r,) = rollout_batch(engine, tok, [question], 1, search_fn, cfg.rollout, seed=1)
    hits = _passages2string(search(load_index(wiki[1]), ["first nobel prize physics"], 3)[0])
    block = information_block(hits)
    assert r["response_text"] == TURN1 + block + TURN2
    assert tok.decode(r["prompt_ids"]) == PROMPT
    check_bookkeeping(r, tok, engine)
    (info,) = [c for c in r["chunks"] if c["role"] == "tool"]
    assert info["text"] == block and set(r["loss_mask"][info["start"] : info["end"]]) == {0}
    # tokenised as one string, as generation.py's _process_next_obs does (add_special_tokens=False)
    assert r["response_ids"][info["start"] : info["end"]] == tok(block, add_special_tokens=False)["input_ids"]
    assert r["tool_calls"] == [{"turn": 1, "query": "first nobel prize physics", "result": hits.strip()}]
    assert r["finish"] == "answer" and r["answer"] == "Wilhelm Conrad Röntgen" and r["invalid_actions"] == []


def test_a_turn_without_an_action_gets_search_r1s_invalid_text(tok, wiki):
    cfg = search_r1_cfg(wiki, "rollout.max_turns=2")
    bad = ["<think> I am not sure yet. </think>", "<think> hmm </think> first nobel prize </search>"]
    engine = Scripted(tok, [bad[0], bad[1], TURN2])
    (r,) = rollout_batch(engine, tok, [{"id": "q", "question": QUESTION}], 1, make_search_fn(cfg, wiki[0], {}),
                         cfg.rollout)  # fmt: skip
    # Search-R1: no <search> / <answer> block (an EOS, or a bare </search>): its text, and the rollout goes on
    assert r["response_text"] == bad[0] + INVALID_OBS + bad[1] + INVALID_OBS + TURN2
    check_bookkeeping(r, tok, engine)
    assert [c["text"] for c in r["chunks"] if c["role"] == "tool"] == [INVALID_OBS] * 2  # loss_mask 0 (above)
    invalid_ids = [r["response_ids"][c["start"] : c["end"]] for c in r["chunks"] if c["role"] == "tool"]
    assert invalid_ids == [tok(INVALID_OBS, add_special_tokens=False)["input_ids"]] * 2
    assert [a["turn"] for a in r["invalid_actions"]] == [1, 2] and r["tool_calls"] == []
    assert r["finish"] == "answer" and r["turns"] == 3
    # the default ends the rollout instead: an EOS without an action, a bare </search> ("format")
    default = RolloutConfig(max_model_len=100000)
    (r,) = rollout_batch(Scripted(tok, bad), tok, [{"id": "q", "question": QUESTION}], 1, lambda q: ["x"] * len(q),
                         default)  # fmt: skip
    assert r["finish"] == "eos" and "invalid_actions" not in r
    # the last turn (answer only, as Search-R1's final generation) gets no observation: the rollout ends
    engine = Scripted(tok, [TURN1, bad[0]])
    (r,) = rollout_batch(engine, tok, [{"id": "q", "question": QUESTION}], 1, make_search_fn(cfg, wiki[0], {}),
                         search_r1_cfg(wiki, "rollout.max_turns=1").rollout)  # fmt: skip
    assert r["finish"] == "max_turns" and r["response_text"].endswith("</information>\n\n" + bad[0])


@pytest.mark.parametrize("text", [
    TURN1, TURN2, "<think> a </think><search></search>", "<search> a <search> b </search>",
    "<answer> x </answer> <search> y </search>", "<search> x </answer>", "plain text",
    "<search>\n multi\nline </search>",
])  # fmt: skip
def test_the_action_is_postprocess_predictions(text):
    (action,), (content,) = postprocess_predictions([text])
    act = SEARCH_R1_TEXT.parse(text, RolloutConfig(search_r1_text=True))
    if action is None:
        assert act["kind"] == "act" and act["error"] and not act["calls"]
    elif action == "answer":
        assert act == {"kind": "answer"}
    else:
        assert act == {"kind": "act", "calls": [{"query": content}]}


def test_real_engine_second_turn_reads_the_information_block(micro):
    """The hf engine on the micro policy: the first turn is a scripted search (the policy was trained
    on another prompt), the second the policy's own, generated after Search-R1's information block."""
    from data import data_paths
    from trainer.engine import load_tokenizer, make_engine
    from trainer.questions import load_questions

    _, base, policy, _ = micro
    cfg = load_config(None, ["rollout.search_r1_text=true", "rollout.prompt_template=", "rollout.max_turns=1",
                             "rollout.max_model_len=2048", "rollout.max_tokens_per_turn=32"])  # fmt: skip
    cfg.world = base.world
    tok = load_tokenizer(policy)
    hf = make_engine("hf", policy, cfg.rollout)
    question = load_questions(data_paths(base)["val"])[0]
    first = f"<think> I need to search. </think><search> {question['question']} </search>"
    outputs = []

    class FirstTurnScripted:
        def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None):
            if not outputs:  # turn 1 of the one trajectory
                out = [Completion(tok.encode(first, add_special_tokens=False), [0.0] * len(tok.encode(first)), "stop")]
            else:
                out = hf.generate(prompts, max_tokens, temperature, top_p, stop, seeds)
            outputs.extend(out)
            return out

    search_fn = make_search_fn(base, data_paths(base)["corpus"], {})
    search_r1_fn = make_search_fn(cfg, data_paths(base)["corpus"], {})
    (r,) = rollout_batch(FirstTurnScripted(), tok, [question], 1, search_r1_fn, cfg.rollout, greedy=True)
    assert len(outputs) == 2 and r["turns"] == 2
    block = information_block(search_r1_fn([question["question"]])[0])
    assert block.startswith('\n\n<information>Doc 1(Title: "')  # the title's quotes, which format_hits drops
    assert search_fn([question["question"]])[0].startswith("Doc 1(Title: ") and '(Title: "' not in search_fn([
        question["question"]])[0]  # fmt: skip
    policy, info, second = r["chunks"]
    assert (policy["text"], info["text"]) == (first, block)
    assert r["response_text"] == first + block + tok.decode(outputs[1].token_ids)
    assert set(r["loss_mask"][info["start"] : info["end"]]) == {0} and set(r["loss_mask"][second["start"] :]) == {1}
    assert r["response_ids"][second["start"] :] == outputs[1].token_ids  # the policy's tokens as generated
    assert r["logprobs"][second["start"] :] == outputs[1].logprobs


def test_config_key_and_its_checks():
    assert RolloutConfig().search_r1_text is False
    assert load_config(None, ["rollout.search_r1_text=true"]).rollout.search_r1_text is True
    assert "Search-R1" in key_notes(RolloutConfig)["search_r1_text"]
    for bad in (["rollout.protocol=bapo"], ["rollout.prompt_template='Q: {question}'"], ["rollout.allow_idk=true"]):
        with pytest.raises(ConfigError, match="rollout.search_r1_text"):
            load_config(None, ["rollout.search_r1_text=true", *bad])
    with pytest.raises(ConfigError, match="rollout.search_r1_text"):
        rollout_batch(None, None, [], 1, None, RolloutConfig(search_r1_text=True, protocol="webfilter"))
