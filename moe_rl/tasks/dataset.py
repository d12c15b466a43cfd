"""The dataset task (`task=dataset`): prompts and answers from a file or a hub dataset, scored by a verifier.

Loading (`load_rows`) goes through `datasets`: a .jsonl/.json, .csv or .parquet file with
`load_dataset(<json|csv|parquet>, data_files=...)`, a folder written by `save_to_disk` with
`load_from_disk`, any other folder or a hub id with `load_dataset(path, task.subset, split=task.split)`,
so the hub path is the same code. Every failure (a missing file, a missing field, no rows, a verifier
package not installed, a reward function that does not import or fails its probe) is a ValueError
naming the field, raised when the task is built, which the entry point does at start-up.

Rows. Each row's prompt is `task.template` formatted with its fields ({prompt} = task.prompt_field), its
target the answer field as text. `Example.data` is `(row,)`, the row's index in the loaded split, which
warnings name.

Split. The rows are shuffled with `random.Random(task.split_seed)`; the first round(heldout x n) (at
least 1 when task.heldout > 0) are held out, the rest train. The partition depends on the split seed only,
so every run seed sees the same held-out rows. `examples("train", n, seed)` draws n training rows without
replacement (with replacement when n exceeds them) from `random.Random(split_seed("train", seed))`;
`examples("eval", n, seed)` draws n distinct held-out rows from `split_seed("eval", seed)` (ValueError if
there are fewer). `sample(rng)` (the warm start's demonstrations) draws one training row.

Rewards (moe_rl.tasks.verifiers). A reward that raises or is not a finite number scores 0 with a
RuntimeWarning naming the row; `rewards` reports which rows failed (`rollout/reward_errors`).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import random
import warnings
from pathlib import Path
from typing import Any, ClassVar

from moe_rl.tasks.base import Example, Task, split_seed
from moe_rl.tasks.config import TaskConfig, template_fields
from moe_rl.tasks.verifiers import (
    RewardFnExit,
    exit_message,
    load_reward_fn,
    make_verifier,
    one_line,
    reference_number,
)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""File suffix -> the `datasets` packaged builder that reads it."""

WARMSTART_PROBE_ROWS = 32
"""Training rows whose answers must score 1 as responses when the warm start is on (its demonstrations)."""


def _looks_like_path(path: str) -> bool:
    """A path the user meant as local (absolute, ./, ../, ~, or a data-file suffix), not a hub id."""
    return path.startswith(("/", ".", "~")) or Path(path).suffix.lower() in FILE_BUILDERS


def load_rows(cfg: TaskConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of `cfg.path` (split `cfg.split`) as dicts, and the dataset's field names.

    ValueError naming task.path / task.split for a missing file, an unreadable one or no rows.
    """
    import datasets  # heavy (pyarrow, pandas): only runs on a dataset pay for it

    path = Path(cfg.path).expanduser()
    where = f"task.path={cfg.path}"
    if not path.exists() and _looks_like_path(cfg.path):
        raise ValueError(f"{where}: no such file or folder")
    if path.is_file() and path.suffix.lower() not in FILE_BUILDERS:
        raise ValueError(f"{where}: unknown file type {path.suffix!r}; expected one of {sorted(FILE_BUILDERS)}")
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"{where}: the file is empty (the dataset has no rows)")
    saved = path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists())
    if cfg.subset is not None and (path.is_file() or saved):
        raise ValueError(f"task.subset={cfg.subset}: a hub dataset's configuration name, but {cfg.path} is local")
    was_verbose, level = datasets.utils.logging.is_progress_bar_enabled(), datasets.utils.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # errors come back as one line
    try:
        if path.is_file():
            data = datasets.load_dataset(
                FILE_BUILDERS[path.suffix.lower()], data_files={cfg.split: str(path)}, split=cfg.split
            )
        elif saved:
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                if cfg.split not in data:
                    raise ValueError(f"task.split={cfg.split!r}: {cfg.path} holds the splits {sorted(data)}")
                data = data[cfg.split]
        else:  # a folder of data files, or a hub id
            data = datasets.load_dataset(str(path) if path.is_dir() else cfg.path, cfg.subset, split=cfg.split)
    except Exception as err:  # datasets raises many types (file, parse, hub errors): one line either way
        if str(err).startswith("task."):
            raise
        if "corresponds to no data" in str(err):  # datasets' words for a split with no rows ("[]")
            raise ValueError(f"{where}: the dataset has no rows (split {cfg.split!r})") from err
        if path.is_file() and (bad := _not_utf8(path)):
            raise ValueError(f"{where}: {bad}; save the file as UTF-8") from err
        cause = _root_cause(err)
        raise ValueError(f"{where}: cannot load split {cfg.split!r} ({type(cause).__name__}: {one_line(cause)})") from err
    finally:
        datasets.utils.logging.set_verbosity(level)
        if was_verbose:
            datasets.utils.logging.enable_progress_bar()
    if len(data) == 0:
        raise ValueError(f"{where}: the dataset has no rows (split {cfg.split!r})")
    try:
        rows = data.to_list()
    except UnicodeDecodeError as err:  # pyarrow keeps a bad byte in a string column; decoding it fails here
        bad = _not_utf8(path) if path.is_file() else None
        raise ValueError(f"{where}: {bad or one_line(err)}; save the file as UTF-8") from err
    return rows, list(data.column_names)


def _not_utf8(path: Path) -> str | None:
    """Where a file first fails to decode as UTF-8 ("line 3, column 7: byte 0xff is not UTF-8"), or None."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        line = data.count(b"\n", 0, err.start) + 1
        return f"line {line}, column {err.start - line_start + 1}: byte 0x{data[err.start]:02x} is not UTF-8"
    return None


def _root_cause(err: BaseException) -> BaseException:
    """The innermost explicit cause (`raise ... from`) of an error: datasets wraps a JSON parse error in
    DatasetGenerationError. Implicit contexts are not followed: there, they are its fallbacks' errors."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _check_text(option: str, name: str, value: Any, row: int, path: str) -> None:
    """The rule for a field that becomes text: a string as it is, an integer in decimal; anything else (a
    float, a bool, a list, a struct, bytes) is refused naming the field, the row and the type, since its
    printed form ('14.0', '[7, 7]', "{'text': ...}") is rarely the text meant."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ValueError(
        f"{option}: field {name!r} of row {row} of {path} is a {type(value).__name__} ({shown}), not text; "
        "strings are taken as they are and integers in decimal: store this column as strings"
    )


def _texts(
    cfg: TaskConfig, rows: list[dict[str, Any]], fields: list[str]
) -> tuple[list[str], list[str]]:
    """Each row's formatted prompt and answer text; ValueError naming a missing field, an empty value, or a
    value that is not text (`_check_text`)."""
    wanted = [("task.prompt_field", cfg.prompt_field), ("task.answer_field", cfg.answer_field)]
    wanted += [("task.template", name) for name in template_fields(cfg.template) if name != "prompt"]
    for option, name in wanted:
        if name not in fields:
            raise ValueError(f"{option}: {name!r} is not a field of {cfg.path}; its fields are {fields}")
    prompts, answers = [], []
    for i, row in enumerate(rows):
        for option in ("prompt_field", "answer_field"):
            if row[getattr(cfg, option)] is None:
                raise ValueError(f"task.{option}: row {i} of {cfg.path} has no {getattr(cfg, option)!r} (null)")
        for option, name in wanted:
            _check_text(option, name, row[name], i, cfg.path)
        try:
            prompts.append(cfg.template.format(**{**row, "prompt": row[cfg.prompt_field]}))
        except (ValueError, TypeError, KeyError, IndexError) as err:
            raise ValueError(f"task.template={cfg.template!r}: cannot format row {i}: {one_line(err)}") from err
        answers.append(str(row[cfg.answer_field]))
    return prompts, answers


class DatasetTask(Task):
    """Rows of a dataset with a held-out split and a verifier or reward function (module docstring)."""

    name = "dataset"
    min_difficulty = 1
    max_difficulty = 1
    reward_can_fail: ClassVar[bool] = True

    def __init__(self, cfg: TaskConfig) -> None:
        super().__init__(1)
        cfg.validate()
        self.cfg = cfg
        self.rows, self.fields = load_rows(cfg)
        self.prompts, self.answers = _texts(cfg, self.rows, self.fields)
        first = {}  # each distinct (prompt, answer) -> its first row
        for i, pair in enumerate(zip(self.prompts, self.answers, strict=True)):
            first.setdefault(pair, i)
        repeated = len(self.rows) - len(first)
        kept = sorted(first.values()) if cfg.dedupe else list(range(len(self.rows)))
        order = list(kept)
        random.Random(cfg.split_seed).shuffle(order)
        k = max(1, round(cfg.heldout * len(order))) if cfg.heldout > 0 else 0
        self.heldout_rows, self.train_rows = order[:k], order[k:]
        train_prompts = {self.prompts[i] for i in self.train_rows}
        leaked = sum(self.prompts[i] in train_prompts for i in self.heldout_rows)
        if cfg.dedupe and repeated:
            warnings.warn(f"task.dedupe=true: dropped {repeated} repeated rows of {cfg.path} "
                          f"({len(kept)} distinct kept)", RuntimeWarning, stacklevel=2)
        if (repeated and not cfg.dedupe) or leaked:
            again = f"{repeated} of its {len(self.rows)} rows repeat an earlier row; " if not cfg.dedupe else ""
            warnings.warn(
                f"{cfg.path}: {again}{leaked} of the {len(self.heldout_rows)} held-out rows have a prompt that "
                "is also a training prompt, so they measure recall, not generalisation"
                + (": task.dedupe=true drops repeated rows" if repeated and not cfg.dedupe else ""),
                RuntimeWarning,
                stacklevel=2,
            )
        if not self.train_rows:
            raise ValueError(
                f"task.heldout={cfg.heldout}: {cfg.path} has {len(order)} rows, all held out; lower it or add rows"
            )
        self.verifier = make_verifier(cfg.verifier)  # imports math-verify for task.verifier=math
        if cfg.reward_fn is None and cfg.verifier == "last_number":
            missing = next((i for i, a in enumerate(self.answers) if reference_number(a) is None), None)
            if missing is not None:
                raise ValueError(
                    f"task.verifier=last_number: the answer of row {missing} of {cfg.path} holds no number "
                    f"({self.answers[missing][:80]!r})"
                )
        self.reward_fn = load_reward_fn(cfg.reward_fn) if cfg.reward_fn is not None else None
        if self.reward_fn is not None:
            self._probe()

    def __repr__(self) -> str:
        return f"DatasetTask({self.cfg.path!r}, {len(self.train_rows)} train / {len(self.heldout_rows)} held out)"

    def row_example(self, row: int) -> Example:
        """The example of dataset row `row`."""
        return Example(prompt=self.prompts[row], target=self.answers[row], data=(row,))

    def _score(self, row: int, response: str) -> float:
        """The row's reward; raises when the reward function raises or returns a non-finite number."""
        if self.reward_fn is None:
            value = self.verifier(response, self.answers[row])
        else:
            value = self.reward_fn(self.prompts[row], response, dict(self.rows[row]))
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"returned {value!r}, not a finite float")
        return float(value)

    def _probe(self) -> None:
        """Call task.reward_fn once on the first training row, its answer as the response."""
        row = self.train_rows[0]
        try:
            self._score(row, self.answers[row])
        except SystemExit as err:
            raise ValueError(exit_message(err, self.cfg.reward_fn, f"on a probe row (row {row})")) from None
        except KeyboardInterrupt as err:
            raise RewardFnExit(exit_message(err, self.cfg.reward_fn, f"on a probe row (row {row})")) from None
        except Exception as err:
            raise ValueError(
                f"task.reward_fn={self.cfg.reward_fn} failed on a probe row (row {row}, its answer as the "
                f"response): {type(err).__name__}: {one_line(err)}"
            ) from err

    def rewards(self, examples: list[Example], responses: list[str]) -> tuple[list[float], list[bool]]:
        """Each response's reward and whether it failed (then 0, with a warning naming the row)."""
        scores, failed = [], []
        for example, response in zip(examples, responses, strict=True):
            (row,) = example.data
            try:
                scores.append(self._score(row, response))
                failed.append(False)
            except (SystemExit, KeyboardInterrupt) as err:  # not a failed row: the user's code wants out
                raise RewardFnExit(exit_message(err, self.cfg.reward_fn, f"on dataset row {row}")) from None
            except Exception as err:  # a user's reward function may fail in any way: the run goes on
                what = self.cfg.reward_fn or f"task.verifier={self.cfg.verifier}"
                warnings.warn(
                    f"reward {what} failed on dataset row {row} ({type(err).__name__}: {one_line(err)}); scored 0",
                    RuntimeWarning,
                    stacklevel=2,
                )
                scores.append(0.0)
                failed.append(True)
        return scores, failed

    def reward(self, example: Example, response: str) -> float:
        """The verifier's or reward function's score (0 with a warning when it fails)."""
        return self.rewards([example], [response])[0][0]

    def is_correct(self, example: Example, response: str) -> bool:
        """Whether the response earns full marks (reward 1)."""
        return self.reward(example, response) == 1.0

    def solve(self, example: Example) -> str:
        """The answer field: the warm start's demonstration (a full response only where the data has one)."""
        return example.target

    def difficulty_of(self, example: Example) -> int:
        """1: a dataset has no difficulty knob."""
        return 1

    @property
    def max_response_len(self) -> int:
        """The longest answer in characters (an upper bound on its tokens under char and byte-level BPE of
        ASCII text)."""
        return max(len(a) for a in self.answers)

    def sample(self, rng: random.Random) -> Example:
        """One training row, drawn uniformly."""
        return self.row_example(rng.choice(self.train_rows))

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """`n` training rows (without replacement while they last) or `n` distinct held-out rows (module
        docstring); ValueError when more held-out rows are asked for than there are."""
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        rng = random.Random(split_seed(split, seed))
        if split == "eval":
            if n > len(self.heldout_rows):
                raise ValueError(
                    f"{n} held-out rows are needed but task.heldout={self.cfg.heldout} holds out "
                    f"{len(self.heldout_rows)} of {self.cfg.path}'s {len(self.rows)} rows"
                )
            return [self.row_example(r) for r in rng.sample(self.heldout_rows, n)]
        if n <= len(self.train_rows):
            return [self.row_example(r) for r in rng.sample(self.train_rows, n)]
        return [self.row_example(rng.choice(self.train_rows)) for _ in range(n)]

    @property
    def alphabet(self) -> str:
        """Every character of every row's prompt and answer (held-out rows too: a character vocabulary must
        cover every prompt the policy is shown), in first-seen order."""
        return "".join(dict.fromkeys("".join(self.prompts) + "".join(self.answers)))

    def corpus(self) -> list[str]:
        """The text a BPE tokenizer is trained on: the training rows' prompts and answers (byte-level BPE
        encodes any text, so held-out rows need not be seen)."""
        return [text for r in self.train_rows for text in (self.prompts[r], self.answers[r])]

    def identity(self) -> dict[str, Any]:
        """What of this task determines a warm start's weights: the settings that shape the rows and their
        rewards, and the sha256 of every row's fields (a part of the warm start's cache key)."""
        digest = hashlib.sha256()
        for row in self.rows:
            digest.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\n")
        c = self.cfg
        return dict(
            rows=digest.hexdigest(), prompt_field=c.prompt_field, answer_field=c.answer_field, template=c.template,
            verifier=c.verifier, reward_fn=c.reward_fn, heldout=c.heldout, split_seed=c.split_seed,
        )
