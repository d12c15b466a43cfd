"""Typed task config (`task.*`): a synthetic task by name and difficulty, or a dataset (`task=dataset`).

`TaskConfig.validate` checks what needs no file; loading the dataset, its fields, the verifier's package
and `task.reward_fn` is checked when the task is built (`moe_rl.tasks.build_task`), which the entry point
does at start-up too (`moe_rl.startup.load_task`), so every bad input stops the run in one line.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

from moe_rl.tasks.registry import TASKS
from moe_rl.tasks.verifiers import REWARD_FN_SPEC, VERIFIERS

DATASET = "dataset"
PROMPT_OVERFLOW = ("refuse", "truncate")
"""`task.name` of the dataset task (moe_rl.tasks.dataset); not in the synthetic registry `TASKS`."""


@dataclass
class TaskConfig:
    """Which verifiable task to train on."""

    name: str = "arithmetic"
    """One of moe_rl.tasks.TASKS (arithmetic, sort, countdown), or dataset: rows of a file or hub dataset
    (task.path; preset task=dataset)."""
    difficulty: int = 1
    """The task's knob: operand digits (arithmetic), items (sort), numbers (countdown). The preset
    task=sort_long is sort at 16 items: 31-character answers, 32 response tokens with EOS. Must stay 1
    for task.name=dataset."""
    mix: list[int] = field(default_factory=list)
    """Mixed difficulties: when non-empty, each example's difficulty is drawn uniformly from this list,
    from the example's own random stream (moe_rl.tasks.mixed), so one policy trains and is evaluated on
    several answer lengths; e.g. [2, 4, 8, 16] with task=sort gives responses of 4 to 32 tokens with EOS.
    task.difficulty then draws nothing (it must still be valid); every entry must be in the task's
    difficulty range, and sampler.max_new_tokens must fit the longest. Empty (default): task.difficulty.
    Synthetic tasks only."""
    chat_template: bool = False
    """Wrap each prompt as one user turn in the tokenizer's chat template (pretrained chat models); the
    run stops with an error if the tokenizer has none. Needs warmstart.enabled=false."""
    path: str | None = None
    """task.name=dataset: a local .jsonl, .json, .csv or .parquet file, a folder written by datasets'
    save_to_disk, a folder of data files, or a hub id (openai/gsm8k). Loaded with datasets.load_dataset
    or load_from_disk, so a hub id takes the same code path as a file. Rows are held in memory."""
    subset: str | None = None
    """The dataset's configuration name (load_dataset's second argument), e.g. main for openai/gsm8k;
    null for files and single-configuration datasets."""
    split: str = "train"
    """The split to load; the held-out rows are carved out of it (task.heldout). A single file is
    loaded as a split of this name."""
    prompt_field: str = "question"
    """The field holding the prompt text."""
    answer_field: str = "answer"
    """The field holding the reference answer the verifier compares against. It is also the warm
    start's demonstration, so warmstart.enabled=true needs it to be a full response the verifier
    accepts (checked at start-up on the first rows)."""
    template: str = "{prompt}"
    """How a row becomes the prompt: a str.format template whose {prompt} is the prompt field and whose
    other {names} are fields of the row, e.g. "Question: {prompt}\\nAnswer:". No attribute or index
    access. On the command line, quote it: 'task.template="Q: {prompt} A:"'."""
    verifier: str = "exact"
    """Built-in reward, 1 or 0 (moe_rl.tasks.verifiers): exact (after normalisation), last_number (the
    GSM8K convention) or math (the math-verify package: pip install -e ".[math]"). Replaced by
    task.reward_fn when that is set."""
    reward_fn: str | None = None
    """package.module:function scoring instead of task.verifier: called as function(prompt, response,
    example) with the formatted prompt, the decoded response and the dataset row (a dict), it returns
    a float. At start-up it must import, be callable and return a finite float on a probe row (the
    first training row, its answer as the response). A row on which it raises or returns a non-finite
    value scores 0 with a warning naming the row (rollout/reward_errors counts them)."""
    heldout: float = 0.1
    """Fraction of the rows held out for evaluation (rounded, at least one row when > 0); the warm
    start's and eval's prompts come from them, training prompts from the rest. 0 holds out nothing
    (then eval.size=0, eval.expected_size=0 and warmstart.enabled=false)."""
    split_seed: int = 0
    """Seed of the train / held-out partition of the rows. Fixed across run seeds, so every run of a
    dataset is evaluated on the same held-out rows, as eval.seed fixes a synthetic task's eval set."""
    max_prompt_tokens: int | None = None
    """A dataset prompt longer than this many tokens (of the policy's tokenizer, formatted) is handled by
    `prompt_overflow`; None: only the model's own limit applies (a prompt's tokens plus
    sampler.max_new_tokens must fit its positions, always checked at start-up)."""
    prompt_overflow: str = "refuse"
    """What a prompt over max_prompt_tokens gets: `refuse` (start-up fails naming the longest row and how
    many are over) or `truncate` (its first max_prompt_tokens tokens are kept, decoded back to text, with a
    one-line warning counting the rows cut)."""
    dedupe: bool = False
    """Drop repeated rows (the same formatted prompt and answer) before the split, keeping each one's first
    occurrence. Without it repeated rows are kept, and a warning counts them and the held-out rows whose
    prompt is also a training prompt (which then measure recall, not generalisation)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad task field that needs no file to check."""
        if self.name == DATASET:
            self._validate_dataset()
            return
        if self.name not in TASKS:
            raise ValueError(f"task.name={self.name!r}: expected one of {[*sorted(TASKS), DATASET]}")
        if self.path is not None:
            raise ValueError(
                f"task.path={self.path} is read by the dataset task only, but task.name={self.name}: "
                "select it with task=dataset"
            )

    def _validate_dataset(self) -> None:
        if not self.path:
            raise ValueError(
                "task.name=dataset needs task.path: a .jsonl, .json, .csv or .parquet file, a folder saved "
                "by datasets, or a hub id"
            )
        if self.mix or self.difficulty != 1:
            raise ValueError(
                f"task.mix={self.mix}, task.difficulty={self.difficulty}: a dataset has no difficulty knob "
                "(set task.mix=[] and task.difficulty=1)"
            )
        for name in ("split", "prompt_field", "answer_field"):
            if not getattr(self, name):
                raise ValueError(f"task.{name} is empty")
        if self.verifier not in VERIFIERS:
            raise ValueError(f"task.verifier={self.verifier!r}: expected one of {VERIFIERS}")
        if self.reward_fn is not None and REWARD_FN_SPEC.fullmatch(self.reward_fn) is None:
            raise ValueError(f"task.reward_fn={self.reward_fn!r}: expected package.module:function")
        if not 0 <= self.heldout < 1:
            raise ValueError(f"task.heldout={self.heldout}: must be in [0, 1)")
        if self.split_seed < 0:
            raise ValueError(f"task.split_seed={self.split_seed}: must be >= 0")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"task.max_prompt_tokens={self.max_prompt_tokens}: must be >= 1 (or null)")
        if self.prompt_overflow not in PROMPT_OVERFLOW:
            raise ValueError(f"task.prompt_overflow={self.prompt_overflow!r}: expected one of {PROMPT_OVERFLOW}")
        template_fields(self.template)


def template_fields(template: str) -> list[str]:
    """The field names `template` reads ({prompt} included); ValueError naming task.template when it is
    not a str.format template of plain names."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(f"task.template={template!r}: {err}") from err
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise ValueError(
            f"task.template={template!r}: {{{bad[0]}}} is not a field name (write {{name}}; no positions, "
            "attributes or indexes; double a brace to write one: {{ }})"
        )
    return names
