"""The dataset task (task=dataset): every file format, the split, verifiers, reward functions by import
path, the BPE tokenizer, start-up errors, and a 2-step run of +experiment=own_data. Offline: files only."""

import json
import math
import os
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from moe_rl.models import ModelConfig, build_tokenizer
from moe_rl.models.tokenizer import policy_tokenizer
from moe_rl.startup import load_task
from moe_rl.tasks import DatasetTask, TaskConfig, build_task, make_task
from moe_rl.tasks.verifiers import exact, last_number_match, normalise
from moe_rl.trainer.step_metrics import rollout_metrics
from moe_rl.warmstart import WarmStartConfig, cache_key
from tests.integration.test_train_loop import compose_config

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "gsm_style.jsonl"
ROWS = [{"question": f"What is {a} plus {a + 1}?", "answer": f"#### {2 * a + 1}", "id": a} for a in range(20)]
FORMATS = ["jsonl", "json", "csv", "parquet", "save_to_disk", "save_to_disk_dict", "folder"]


def write_rows(folder: Path, fmt: str, rows: list[dict] = ROWS) -> Path:
    """`rows` written in format `fmt` (by `datasets` itself, except the plain JSON array) under `folder`."""
    import datasets

    data = datasets.Dataset.from_list(rows)
    if fmt == "jsonl":
        data.to_json(folder / "rows.jsonl")  # JSON Lines, datasets' default
        return folder / "rows.jsonl"
    if fmt == "json":
        (folder / "rows.json").write_text(json.dumps(rows))
        return folder / "rows.json"
    if fmt == "csv":
        data.to_csv(folder / "rows.csv", index=False)
        return folder / "rows.csv"
    if fmt == "parquet":
        data.to_parquet(folder / "rows.parquet")
        return folder / "rows.parquet"
    if fmt == "save_to_disk":
        data.save_to_disk(folder / "saved")
        return folder / "saved"
    if fmt == "save_to_disk_dict":
        datasets.DatasetDict({"train": data, "test": data.select(range(2))}).save_to_disk(folder / "saved_dict")
        return folder / "saved_dict"
    (folder / "data").mkdir()  # a folder of data files: load_dataset(path), the call a hub id makes
    data.to_json(folder / "data" / "train.jsonl")
    return folder / "data"


def dataset_cfg(path: Path | str, **fields) -> TaskConfig:
    return TaskConfig(name="dataset", path=str(path), **fields)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_the_same_rows(tmp_path, fmt):
    """JSONL, JSON, CSV, parquet, save_to_disk (Dataset and DatasetDict) and a folder of files give the
    same prompts, answers and held-out split; answers of any type become text."""
    task = DatasetTask(dataset_cfg(write_rows(tmp_path, fmt), template="Q: {prompt} (#{id})"))
    assert task.prompts == [f"Q: {r['question']} (#{r['id']})" for r in ROWS]
    assert task.answers == [r["answer"] for r in ROWS]
    assert task.fields == ["question", "answer", "id"]
    assert (len(task.train_rows), len(task.heldout_rows)) == (18, 2)


def test_split_is_deterministic_disjoint_and_fixed_across_run_seeds(tmp_path):
    """The partition is a function of task.split_seed alone: two loads agree, another split seed differs,
    train and held-out rows are disjoint and cover the data; training draws never reach held-out rows,
    and the eval draw is a pure function of its seed."""
    path = write_rows(tmp_path, "jsonl")
    a, b = DatasetTask(dataset_cfg(path, heldout=0.25)), DatasetTask(dataset_cfg(path, heldout=0.25))
    other = DatasetTask(dataset_cfg(path, heldout=0.25, split_seed=1))
    assert (a.train_rows, a.heldout_rows) == (b.train_rows, b.heldout_rows)
    assert set(other.heldout_rows) != set(a.heldout_rows)
    assert sorted(a.train_rows + a.heldout_rows) == list(range(20)) and len(a.heldout_rows) == 5
    held = set(a.heldout_rows)
    for seed in range(5):
        rows = [ex.data[0] for ex in a.examples("train", 10, seed)]
        assert not held & set(rows) and len(set(rows)) == 10  # without replacement while rows last
    assert len(a.examples("train", 40, 0)) == 40  # more than there are: with replacement
    assert a.examples("train", 5, 0) != a.examples("train", 5, 1)
    assert a.examples("eval", 5, 7) == b.examples("eval", 5, 7)
    assert {ex.data[0] for ex in a.examples("eval", 5, 3)} == held
    with pytest.raises(ValueError, match="held-out rows"):
        a.examples("eval", 6, 0)


def test_verifiers_exact_and_last_number():
    """exact compares normal forms; last_number compares the response's last number with the number after
    the answer's last ####, exactly as rationals, commas read, no number scoring 0."""
    assert normalise("  Paris\n  IS  ﬁne ") == "paris is fine" and exact("PARIS ", "paris") == 1.0
    assert exact("Paris.", "Paris") == 0.0
    answer = "48 / 2 = 24 clips in May.\n48 + 24 = 72\n#### 72"
    assert last_number_match("so 72", answer) == 1.0 and last_number_match("72.0", answer) == 1.0
    assert last_number_match("72 then 71", answer) == 0.0 and last_number_match("seventy-two", answer) == 0.0
    assert last_number_match("-5", "#### -5") == 1.0 and last_number_match("1,234", "1234") == 1.0
    assert last_number_match("1.5", "3/2 = 1.50") == 1.0


def test_math_verifier():
    """math accepts equivalent answers in other forms (math-verify) and refuses different values."""
    pytest.importorskip("math_verify")
    from moe_rl.tasks.verifiers import MathVerifier

    verify = MathVerifier()
    assert verify("The answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert verify("The answer is $\\boxed{3}$", "\\frac{6}{2}") == 1.0
    assert verify("The answer is 4", "3") == 0.0


def test_math_verifier_missing_package_is_a_start_up_error(tmp_path, monkeypatch):
    """Without math-verify, task.verifier=math stops at build time naming the field and the install command docs/training.md gives for the extra."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # what an absent package looks like to import
    with pytest.raises(ValueError, match=r"task\.verifier=math .*pip install -e \"\.\[math\]\" in the repository"):
        DatasetTask(dataset_cfg(write_rows(tmp_path, "jsonl"), verifier="math"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.helpers.dataset_rewards_broken:fn", r"task\.reward_fn=tests\.helpers\.dataset_rewards_broken:fn: cannot import .*ImportError"),
        ("no_such_module_xyz:fn", r"cannot import no_such_module_xyz .*ModuleNotFoundError"),
        ("tests.helpers.dataset_rewards:missing", r"has no attribute missing"),
        ("tests.helpers.dataset_rewards:NOT_A_FUNCTION", r"is a int, not a function"),
        ("tests.helpers.dataset_rewards:always_raises", r"failed on a probe row .*RuntimeError: reward server unreachable"),
        ("tests.helpers.dataset_rewards:returns_inf", r"failed on a probe row .*returned inf, not a finite float"),
        ("tests.helpers.dataset_rewards_exit:fn", r"task\.reward_fn=tests\.helpers\.dataset_rewards_exit:fn called sys\.exit\(4\) while tests\.helpers\.dataset_rewards_exit was imported"),
        ("tests.helpers.dataset_rewards:exits", r"task\.reward_fn=tests\.helpers\.dataset_rewards:exits called sys\.exit\(3\) on a probe row"),
        ("not a path", r"expected package\.module:function"),
    ],
)
def test_reward_fn_is_validated_at_start_up(tmp_path, spec, message):
    """task.reward_fn must import, be callable and return a finite float on the probe row; else ValueError."""
    with pytest.raises(ValueError, match=message):
        DatasetTask(dataset_cfg(write_rows(tmp_path, "jsonl"), reward_fn=spec))


def test_failing_reward_rows_score_zero_with_a_warning_and_are_counted(tmp_path):
    """A row whose reward raises, is NaN or is not a number scores 0, warns naming its dataset row, and is
    flagged; the others keep their reward, and rollout/reward_errors sums the flags."""
    task = DatasetTask(dataset_cfg(write_rows(tmp_path, "jsonl"), reward_fn="tests.helpers.dataset_rewards:flaky"))
    examples = [task.row_example(r) for r in (3, 4, 5, 6)]
    with pytest.warns(RuntimeWarning) as caught:
        scores, failed = task.rewards(examples, ["boom", "fine", "nan", "text"])
    assert scores == [0.0, 1.0, 0.0, 0.0] and failed == [True, False, True, True]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3 and "dataset row 3 (ZeroDivisionError: boom)" in messages[0]
    assert "dataset row 5" in messages[1] and "returned nan" in messages[1] and "dataset row 6" in messages[2]
    rows = [[s, 2.0, 1.0, float(f)] for s, f in zip(scores, failed, strict=True)]
    assert rollout_metrics(rows, 1, reward_can_fail=True)["rollout/reward_errors"] == 3.0
    assert "rollout/reward_errors" not in rollout_metrics(rows, 1)  # a synthetic task's verifier cannot fail


@pytest.mark.parametrize(("name", "says"), [("exits_on_wrong", r"called sys\.exit\(3\) on dataset row 3"),
                                            ("interrupted_on_wrong", r"was interrupted \(KeyboardInterrupt\) on dataset row 3")])
def test_reward_fn_that_exits_mid_run_stops_in_one_line_naming_it(tmp_path, name, says):
    """A reward function that calls sys.exit or raises KeyboardInterrupt on a sampled row stops the run with a RunError (one line on the console) naming the function and the row, instead of ending the process silently."""
    from moe_rl.errors import one_line
    from moe_rl.tasks.verifiers import RewardFnExit

    task = DatasetTask(dataset_cfg(write_rows(tmp_path, "jsonl"), reward_fn=f"tests.helpers.dataset_rewards:{name}"))
    with pytest.raises(RewardFnExit, match=rf"^task\.reward_fn=tests\.helpers\.dataset_rewards:{name} {says}") as err:
        task.rewards([task.row_example(3)], ["not the answer"])
    assert one_line(err.value) == str(err.value) and "\n" not in str(err.value)


def test_reward_fn_gets_prompt_response_and_row(tmp_path):
    """The reward function sees the formatted prompt, the response and the whole row; is_correct means 1."""
    task = DatasetTask(dataset_cfg(write_rows(tmp_path, "jsonl"), reward_fn="tests.helpers.dataset_rewards:last_digit_match"))
    example = task.row_example(0)
    assert task.reward(example, "...1") == 1.0 and task.is_correct(example, "1") and not task.is_correct(example, "2")


@pytest.mark.parametrize(
    ("rows", "fields", "message"),
    [
        ([], {}, r"task\.path=.*: the file is empty"),
        (ROWS, {"answer_field": "solution"}, r"task\.answer_field: 'solution' is not a field .*\['question', 'answer', 'id'\]"),
        (ROWS, {"template": "{prompt} {context}"}, r"task\.template: 'context' is not a field"),
        (ROWS, {"heldout": 0.99}, r"task\.heldout=0\.99: .* all held out"),
        ([{"question": "q", "answer": None}], {}, r"task\.answer_field: row 0 .* \(null\)"),
        ([{"question": "q", "answer": "none"}] * 2, {"verifier": "last_number"}, r"task\.verifier=last_number: the answer of row 0"),
    ],
)
def test_bad_data_is_refused_naming_the_field(tmp_path, rows, fields, message):
    """Empty files, missing fields, nulls, answers without a number and a split with no training rows are
    ValueErrors naming the field."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=message):
        DatasetTask(dataset_cfg(path, **fields))


def test_unreadable_files_missing_paths_and_splits(tmp_path):
    """A missing path, an unknown suffix, malformed JSON (its parser's own words), a JSON array with no rows,
    a hub subset for a file and an unknown split of a saved DatasetDict are each a ValueError naming the field."""
    with pytest.raises(ValueError, match=r"task\.path=.*nope\.jsonl: no such file"):
        DatasetTask(dataset_cfg(tmp_path / "nope.jsonl"))
    files = {"rows.txt": ("q a", r"unknown file type '\.txt'"), "bad.jsonl": ("{not json\n", r"ArrowInvalid: JSON parse"),
             "empty.json": ("[]", r"the dataset has no rows")}
    for name, (text, message) in files.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=r"task\.path=.*" + message):
            DatasetTask(dataset_cfg(tmp_path / name))
    with pytest.raises(ValueError, match=r"task\.subset=main: .* is local"):
        DatasetTask(dataset_cfg(tmp_path / "bad.jsonl", subset="main"))
    with pytest.raises(ValueError, match=r"task\.split='validation': .* holds the splits \['test', 'train'\]"):
        DatasetTask(dataset_cfg(write_rows(tmp_path, "save_to_disk_dict"), split="validation"))


def test_config_checks_that_need_no_file():
    """validate() refuses dataset options that cannot work, before any file is read."""
    cases = {
        "task.path=x.jsonl": "task.path",  # a synthetic task reads no file
        "model.tokenizer=bpe": "model.tokenizer=bpe",  # trains on a dataset's text only
        "task=dataset task.reward_fn=nocolon": "task.reward_fn",
        "task=dataset task.heldout=1.0": "task.heldout",
        "task=dataset task.mix=[1,2]": "task.mix",
        "task=dataset warmstart.pretrain_steps=5": "warmstart.pretrain_steps",
        "task=dataset task.template='{0}'": "task.template",
        "model.pretrained=org/model task=dataset model.tokenizer=bpe": "model.tokenizer=bpe: model.pretrained",
        "task=dataset model.tokenizer=bpe model.bpe_vocab_size=100": "model.bpe_vocab_size",
    }
    for overrides, field in cases.items():
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            compose_config(overrides.split())


def test_load_task_checks_held_out_size_and_warm_start():
    """load_task refuses eval or warm-start sets larger than the held-out rows and a warm start whose
    demonstrations (the answers) the reward does not accept, and warns when answers outgrow the sampler;
    the example's answers are full responses."""
    base = ["task=dataset", f"task.path={EXAMPLE}"]
    with pytest.raises(ValueError, match=r"eval\.size / eval\.expected_size: 512 held-out rows"):
        load_task(compose_config([*base, "eval.fit_heldout=false"]))
    with pytest.warns(RuntimeWarning, match=r"evaluating on all 100"), \
            pytest.raises(ValueError, match=r"warmstart\.eval_size: 128 held-out rows"):
        load_task(compose_config(base))  # eval fits its 100 held-out rows; the warm start's eval set does not
    small = [*base, "eval.expected_size=100", "warmstart.eval_size=100"]
    task = load_task(compose_config(small))  # last_number accepts every worked answer as a response
    assert len(task.heldout_rows) == 100
    with pytest.raises(ValueError, match=r"warmstart\.enabled=true .* scores 0\.5 .* set warmstart\.enabled=false"):
        load_task(compose_config([*small, "task.reward_fn=tests.helpers.dataset_rewards:half"]))
    load_task(compose_config([*small, "task.reward_fn=tests.helpers.dataset_rewards:half", "warmstart.enabled=false"]))
    with pytest.warns(RuntimeWarning, match=r"of 900 training answers are longer than sampler\.max_new_tokens=12"):
        load_task(compose_config([*small, "sampler.max_new_tokens=12"]))  # char tokens: answers are 11-31


def test_small_dataset_is_evaluated_on_all_its_held_out_rows_with_a_note(tmp_path):
    """A 200-row file (20 held out) with eval's defaults (64 sampled, 512 teacher-forced) runs as docs/training.md's "your file" command does: one note that eval uses all 20 rows, then eval metrics over those 20."""
    from moe_rl.trainer.run import train
    from tests.integration.test_train_loop import TINY

    rows = [{"q": f"What is {a} plus 1?", "a": str(a + 1)} for a in range(200)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose_config(["task=dataset", f"task.path={path}", "task.prompt_field=q", "task.answer_field=a",
                          "task.verifier=exact", "warmstart.enabled=false", *TINY, "eval.size=64",
                          "eval.expected_size=512", "sampler.max_new_tokens=4", "trainer.steps=1", "logger.wandb=false"])
    with pytest.warns(RuntimeWarning, match=r"holds out 20 of .* rows, fewer than eval\.size=64 / eval\.expected_size=512: evaluating on all 20"):
        load_task(cfg)
    summary = train(cfg, tmp_path / "run")
    final = summary["final"]
    assert {"eval/accuracy", "eval/expected_accuracy", "eval/accuracy_greedy"} <= final.keys()
    assert all(round(final[k] * 20, 6).is_integer() for k in ("eval/accuracy", "eval/accuracy_greedy"))


def test_non_utf8_byte_in_a_jsonl_is_named_by_file_line_and_column(tmp_path):
    """A .jsonl with a byte that is not UTF-8 on its third line fails at start-up naming task.path, the line, the column and the byte."""
    path = write_rows(tmp_path, "jsonl")
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"What", b"Wh\xffat", 1)
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=rf"^task\.path={path}: line 3, column 16: byte 0xff is not UTF-8; save the file as UTF-8$"):
        DatasetTask(dataset_cfg(path))


def test_prompt_longer_than_the_model_holds_is_refused_at_start_up_naming_the_row(tmp_path):
    """A prompt whose tokens plus sampler.max_new_tokens exceed the model's positions is a ValueError at load_task naming the longest row, its length and the fields; prompts that fit pass."""
    rows = [{"question": f"What is {a} plus 1?", "answer": f"#### {a + 1}"} for a in range(200)]
    rows[7]["question"] = "7 " * 300  # 600 characters: 600 char tokens
    rows[9]["question"] = "9 " * 2500  # the longest: 5000
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    small = ["task=dataset", f"task.path={path}", "eval.size=4", "eval.expected_size=4", "warmstart.enabled=false"]
    with pytest.raises(ValueError, match=r"2 of 200 prompts do not fit the model: row 9's prompt is 50\d\d tokens, "
                                         r"and with sampler\.max_new_tokens=32 .* more than model\.max_position_embeddings=512"):
        load_task(compose_config(small))
    load_task(compose_config([*small, "model.max_position_embeddings=8192"]))


def test_max_prompt_tokens_refuses_or_truncates(tmp_path):
    """task.max_prompt_tokens=100 refuses the 2 longer prompts naming the longest row, or with
    prompt_overflow=truncate cuts them to their first 100 tokens (a warning counts them) so the run fits the
    model; the other prompts are untouched; a bad value or mode is refused naming the field."""
    rows = [{"question": f"What is {a} plus 1?", "answer": f"#### {a + 1}"} for a in range(200)]
    rows[7]["question"] = "7 " * 300
    rows[9]["question"] = "9 " * 2500
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    small = ["task=dataset", f"task.path={path}", "eval.size=4", "eval.expected_size=4", "warmstart.enabled=false",
             "task.max_prompt_tokens=100"]
    with pytest.raises(ValueError, match=r"task.max_prompt_tokens=100: 2 of 200 prompts .* longer \(row 9: 50\d\d tokens\)"):
        load_task(compose_config(small))
    with pytest.warns(RuntimeWarning, match=r"task.max_prompt_tokens=100: cut 2 of 200 prompts .* row 9, had 50\d\d"):
        task = load_task(compose_config([*small, "task.prompt_overflow=truncate"]))
    tok = build_tokenizer(task.alphabet)
    assert task.prompts[9] == ("9 " * 50) and len(tok(task.prompts[7], add_special_tokens=False).input_ids) == 100
    assert task.prompts[8] == "What is 8 plus 1?"
    for bad, field in (("task.max_prompt_tokens=0", "task.max_prompt_tokens"), ("task.prompt_overflow=cut", "task.prompt_overflow")):
        with pytest.raises(ValueError, match=field):
            compose_config([*small, bad])


def test_char_tokenizer_covers_the_data_and_synthetic_tokenizer_is_unchanged(tmp_path):
    """char over a dataset has a token for every character of its rows (no <unk>); for a synthetic task it
    is today's tokenizer, token for token."""
    task = DatasetTask(dataset_cfg(write_rows(tmp_path, "jsonl")))
    tok = policy_tokenizer(ModelConfig(), task)
    ids = tok(task.prompts[0] + task.answers[0])["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids, skip_special_tokens=True) == task.prompts[0] + task.answers[0]
    assert policy_tokenizer(ModelConfig(), make_task("sort", 4)).get_vocab() == build_tokenizer().get_vocab()


def test_bpe_is_trained_on_the_data_and_cached_by_content(tmp_path):
    """bpe trains a byte-level BPE on the training text, round-trips any text, is read back from the cache
    for the same text, and gets another cache entry for other text."""
    cfg = ModelConfig(tokenizer="bpe", bpe_vocab_size=300, tokenizer_cache_dir=str(tmp_path / "tok"))
    task = DatasetTask(dataset_cfg(write_rows(tmp_path, "jsonl")))
    tok = policy_tokenizer(cfg, task)
    entries = list((tmp_path / "tok").iterdir())
    assert len(entries) == 1 and len(tok) == 300
    assert len(tok(task.prompts[0])["input_ids"]) < len(task.prompts[0]) / 2  # merges learned from the data
    text = "naïve 🙂 text\twith 1,234"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert policy_tokenizer(cfg, task).get_vocab() == tok.get_vocab() and list((tmp_path / "tok").iterdir()) == entries
    (tmp_path / "other").mkdir()
    policy_tokenizer(cfg, DatasetTask(dataset_cfg(write_rows(tmp_path / "other", "jsonl", ROWS[:10]))))
    assert len(list((tmp_path / "tok").iterdir())) == 2


@pytest.mark.parametrize("value, kind", [([7, 7], "list"), ({"text": "hi"}, "dict"), (14.0, "float"), (True, "bool")])
def test_a_field_that_is_not_text_is_refused_naming_it(tmp_path, value, kind):
    """A prompt, answer or template field holding a list, a struct, a float or a bool (here in parquet, which
    keeps the types) is refused naming the option, field, row and type; integers are taken in decimal."""
    for field, option in (("question", "task.prompt_field"), ("answer", "task.answer_field")):
        rows = [{**r} for r in ROWS]
        rows[3][field] = value
        for r in rows:  # one type per column, as parquet needs
            r[field] = r[field] if r is rows[3] else type(value)() if kind != "float" else float(r["id"])
        folder = tmp_path / f"{field}-{kind}"
        folder.mkdir()
        with pytest.raises(ValueError, match=rf"{option}: field '{field}' of row \d+ of .* is a {kind} .*not text"):
            DatasetTask(dataset_cfg(write_rows(folder, "parquet", rows)))
    ints = [{**r, "answer": 2 * r["id"] + 1} for r in ROWS]
    (tmp_path / "ints").mkdir()
    task = DatasetTask(dataset_cfg(write_rows(tmp_path / "ints", "parquet", ints)))
    assert task.answers[:3] == ["1", "3", "5"]


def test_repeated_rows_are_counted_and_dedupe_drops_them(tmp_path):
    """200 copies of 20 rows: a warning counts the 180 repeats and the held-out rows that are also training
    prompts (all 20 here); task.dedupe=true keeps the 20 distinct rows, says how many it dropped, and then no
    held-out prompt is a training prompt."""
    rows = [ROWS[i % 20] for i in range(200)]
    path = write_rows(tmp_path, "jsonl", rows)
    with pytest.warns(RuntimeWarning, match=r"180 of its 200 rows repeat an earlier row; 20 of the 20 held-out "
                                            r"rows have a prompt that is also a training prompt.*task.dedupe=true"):
        task = DatasetTask(dataset_cfg(path))
    assert len(task.train_rows) + len(task.heldout_rows) == 200
    with pytest.warns(RuntimeWarning, match=r"task.dedupe=true: dropped 180 repeated rows .*\(20 distinct kept\)") as seen:
        task = DatasetTask(dataset_cfg(path, dedupe=True))
    assert not [w for w in seen if "held-out" in str(w.message)]
    assert len(task.train_rows) + len(task.heldout_rows) == 20
    assert not {task.prompts[i] for i in task.heldout_rows} & {task.prompts[i] for i in task.train_rows}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # distinct rows: no warning
        (tmp_path / "distinct").mkdir()
        DatasetTask(dataset_cfg(write_rows(tmp_path / "distinct", "jsonl")))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "no_checksum"])
def test_a_damaged_bpe_cache_entry_is_rebuilt_with_a_warning(tmp_path, damage):
    """A cached tokenizer.json that is garbage, truncated, or has no checksum beside it is rebuilt (one
    warning naming the entry), giving the same tokenizer as before, never a JSON traceback."""
    cfg = ModelConfig(tokenizer="bpe", bpe_vocab_size=300, tokenizer_cache_dir=str(tmp_path / "tok"))
    task = DatasetTask(dataset_cfg(write_rows(tmp_path, "jsonl")))
    vocab = policy_tokenizer(cfg, task).get_vocab()
    (entry,) = (tmp_path / "tok").iterdir()
    cached = entry / "tokenizer.json"
    if damage == "garbage":
        cached.write_text("{not json")
    elif damage == "truncated":
        cached.write_bytes(cached.read_bytes()[:100])
    else:
        (entry / "tokenizer.json.sha256").unlink()
    with pytest.warns(RuntimeWarning, match=f"tokenizer cache entry {entry}.*rebuilding it"):
        again = policy_tokenizer(cfg, task)
    assert again.get_vocab() == vocab and (entry / "tokenizer.json.sha256").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry is trusted again
        assert policy_tokenizer(cfg, task).get_vocab() == vocab


def test_warm_start_key_holds_the_data_and_tokenizer():
    """A dataset's identity and a bpe tokenizer enter the warm-start cache key; the tokenizer cache folder
    does not, and char keeps the keys entries had before model.tokenizer existed (tests/unit/warmstart/test_warmstart_pretraining.py)."""
    m, ws = ModelConfig(), WarmStartConfig()
    base = cache_key(m, "dataset", 1, ws, 0, 24, data={"rows": "a"})
    assert base != cache_key(m, "dataset", 1, ws, 0, 24, data={"rows": "b"})
    assert base != cache_key(replace(m, tokenizer="bpe"), "dataset", 1, ws, 0, 24, data={"rows": "a"})
    assert base == cache_key(replace(m, tokenizer_cache_dir="/elsewhere"), "dataset", 1, ws, 0, 24, data={"rows": "a"})


FORKING_CLI = r"""
import json, os, sys
import moe_rl.train  # torch and transformers, imported once: each case below is a fork of this process

results = []
for case in json.loads(sys.argv[1]):
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child is moe-rl-train with the case's arguments, its stderr into the pipe
        os.close(read_fd)
        os.dup2(write_fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        if case["without_math_verify"]:
            sys.modules["math_verify"] = None  # what an absent package looks like to import
        sys.argv = ["moe-rl-train", *case["args"]]
        code = 0
        try:
            moe_rl.train.main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        sys.stderr.flush()
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        stderr = pipe.read()
    results.append({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "stderr": stderr})
print(json.dumps(results))
"""
"""Runs moe-rl-train once per case in a forked child of one process that imported it: the import of torch
and transformers (about 5 CPU seconds) is paid once instead of once per case."""


def test_bad_input_exits_2_in_one_line_writing_nothing(tmp_path):
    """A missing file, a missing field, an empty dataset, a verifier extra not installed and a reward_fn
    that does not import each make moe-rl-train exit with code 2 and one line naming the field, before
    any run file is written."""
    (tmp_path / "empty.jsonl").write_text("")
    cases = [
        (f"task.path={tmp_path}/missing.jsonl", "task.path"),
        (f"task.path={EXAMPLE} task.answer_field=solution", "task.answer_field"),
        (f"task.path={tmp_path}/empty.jsonl", "task.path"),
        (f"task.path={EXAMPLE} task.verifier=math", "task.verifier=math"),
        (f"task.path={EXAMPLE} task.reward_fn=no_such_module_xyz:score", "task.reward_fn"),
        (f"task.path={EXAMPLE} task.reward_fn=tests.helpers.dataset_rewards_exit:fn", "task.reward_fn=tests.helpers.dataset_rewards_exit:fn called sys.exit(4)"),
    ]
    runs = [tmp_path / f"run{i}" for i in range(len(cases))]
    spec = [{"args": ["task=dataset", *overrides.split(), f"hydra.run.dir={run}"],
             "without_math_verify": "verifier=math" in overrides} for (overrides, _), run in zip(cases, runs, strict=True)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-c", FORKING_CLI, json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (overrides, field), run, result in zip(cases, runs, json.loads(proc.stdout), strict=True):
        assert result["code"] == 2, (overrides, result["stderr"])
        # The example file repeats 3 of its 1000 rows: its one-line note about that comes before the error.
        lines = [line for line in result["stderr"].splitlines()
                 if line.strip() and "rows repeat an earlier row" not in line]
        assert len(lines) == 1 and field in lines[0], (overrides, result["stderr"])
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoint.pt").exists(), overrides


def test_own_data_two_steps(tmp_path, monkeypatch):
    """+experiment=own_data warm-starts (a band from 0, so it stops at its first check) with its BPE, saves,
    loads it back and trains 2 steps evaluated on the held-out rows; a reward function that raises on every
    sampled row scores them 0 and counts them in rollout/reward_errors, and the run goes on to write its
    summary and policy."""
    from moe_rl.trainer.run import train

    monkeypatch.chdir(REPO)  # the experiment's task.path is relative to the repository root
    cfg = compose_config([
        "+experiment=own_data", "warmstart.target_low=0", "warmstart.eval_size=4", f"warmstart.cache_dir={tmp_path}",
        "trainer.steps=2", "trainer.prompts_per_step=2",
        "trainer.group_size=4", "trainer.mini_batches=2", "model.num_layers=1", "sampler.max_new_tokens=8",
        "eval.size=4", "eval.expected_size=4", "eval.at_start=false", "logger.wandb=false", "logger.progress=false",
        f"model.tokenizer_cache_dir={tmp_path / 'tok'}", "task.reward_fn=tests.helpers.dataset_rewards:fussy",
    ])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and summary["steps_done"] == 2
    assert all(r["rollout/reward_errors"] == 8.0 and r["rollout/reward/mean"] == 0.0 for r in rows)
    assert any("failed on dataset row" in str(w.message) for w in caught)
    assert math.isfinite(rows[-1]["train/loss"]) and "eval/accuracy" in rows[-1]
    assert (tmp_path / "run" / "policy" / "tokenizer.json").is_file() and summary["warmstart_accuracy"] == 0.0
    warm = json.loads(next(tmp_path.glob("dataset-*/warmstart.json")).read_text())
    assert warm["steps"] == 0 and warm["data"]["verifier"] == "last_number" and len(warm["data"]["rows"]) == 64
    assert build_task(cfg.task).reward_can_fail


def test_a_reward_whose_mean_overflows_is_said_once_and_every_update_skipped(tmp_path):
    """Issue 56: a reward of 1e308 (finite) makes the group mean overflow: every update is skipped as a
    nonfinite event in events.jsonl, the run finishes, and the console says so once (a RuntimeWarning),
    not once per step and not never."""
    import warnings

    from moe_rl.trainer.run import train
    from tests.integration.test_train_loop import TINY

    cfg = compose_config(["task=dataset", f"task.path={EXAMPLE}", "task.reward_fn=tests.helpers.dataset_rewards:huge",
                          "warmstart.enabled=false", *TINY, "trainer.steps=3", "logger.wandb=false"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(cfg, tmp_path / "run")
    said = [w for w in seen if "not finite: the update is skipped" in str(w.message)]
    assert len(said) == 1
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "nonfinite"] == [0, 1, 2]


def test_the_task_is_built_once_so_a_reward_that_exits_later_stops_in_one_line(tmp_path):
    """Issue 56: the entry point's start-up check and the run share one task, so the reward function is
    probed once; one that exits on its second call stops the run there, in one line naming it, without a
    traceback (it used to be probed twice, and the second probe escaped as a 25-line Hydra traceback)."""
    from tests.integration.test_train_loop import TINY

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "moe_rl.train", "task=dataset", f"task.path={EXAMPLE}",
                           "task.reward_fn=tests.helpers.dataset_rewards_exit_second:fn", "warmstart.enabled=false",
                           *TINY, "trainer.steps=1", "logger.wandb=false", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("moe-rl-train:") and "Warning" not in line]
    assert len(lines) == 1 and "dataset_rewards_exit_second:fn" in lines[0] and "sys.exit(5)" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
