"""Prompt datasets: rows of raw chat messages plus metadata, from JSONL or parquet files or HF
`datasets`; nothing tokenized. The columns read and the per-row overrides (rollout_n,
do_sample) are in docs/agent_loops.md, "Dataset rows"; every column stays in `raw`. Each row
handed out gets a fresh uid, the key GRPO groups its n trajectories by. Every error names the
file and the row (or line).
"""

from __future__ import annotations

import json
import logging
import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tandem.agent.dataset_images import ImageRowError, image_parts, row_images
from tandem.config.schema import DataConfig
from tandem.extras import install_command

logger = logging.getLogger(__name__)


@dataclass
class DatasetRow:
    """One prompt as raw chat messages plus its metadata; `uid` is unique per draw."""

    messages: list[dict[str, Any]]
    index: int = 0
    uid: str = ""
    data_source: str = ""
    ground_truth: Any = None
    reward_model: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    rollout_n: int | None = None  # overrides rollout.n / rollout.val_kwargs.n
    do_sample: bool | None = None  # False: greedy sampling for this row in training
    raw: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)  # one per image part, in order


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a .parquet or .jsonl/.json-lines file, a `datasets.save_to_disk` directory or
    a "<builder>:<data files>" entry (`datasets.load_dataset`) as plain dicts."""
    entry = str(path)
    builder, sep, files = entry.partition(":")
    if sep and builder.isidentifier() and not Path(entry).exists():
        return _load_dataset(builder, files, entry)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist (data.train_files / "
                                "data.val_files)")
    if path.is_dir():
        return _load_from_disk(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as parquet

        return parquet.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        records = []
        for number, line in enumerate(_utf8_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON line ({error.msg}); JSONL files "
                                 "hold one JSON object per line") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: a JSON {type(record).__name__}, not an "
                                 "object; JSONL files hold one JSON object (one row) per line")
            records.append(record)
        return records
    raise ValueError(f"dataset file {str(path)!r}: unknown format {path.suffix!r}; use .parquet "
                     "or .jsonl")


def _datasets(entry: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"dataset {entry!r} needs the HF datasets package: "
                         f"{install_command('datasets', 'datasets')} (or give .jsonl / .parquet "
                         "files)") from None
    datasets.disable_progress_bars()
    return datasets


def _load_from_disk(path: Path) -> list[dict[str, Any]]:
    datasets = _datasets(str(path))
    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise ValueError(f"dataset directory {str(path)!r} is not a datasets.save_to_disk "
                         "directory (no state.json / dataset_dict.json)")
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        raise ValueError(f"dataset directory {str(path)!r} holds the splits {list(loaded)}; name "
                         f"one, e.g. {str(path / next(iter(loaded)))!r}")
    return loaded.to_list()


def _load_dataset(builder: str, files: str, entry: str) -> list[dict[str, Any]]:
    datasets = _datasets(entry)
    data_files = [item for item in files.split(",") if item]
    missing = [item for item in data_files if not any(Path().glob(item)) and not Path(item).exists()]
    if not data_files or missing:
        raise FileNotFoundError(f"dataset {entry!r}: no file {missing or files!r}; give "
                                "'<builder>:<file>[,<file>...]', e.g. 'json:data/train.json'")
    try:
        return datasets.load_dataset(builder, data_files=data_files, split="train").to_list()
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"dataset {entry!r}: datasets.load_dataset({builder!r}, data_files=...) "
                         f"failed: {error}") from None


def _utf8_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        utf16 = data[:2] in (b"\xff\xfe", b"\xfe\xff")
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}"
                         f"{'; it starts with a UTF-16 byte-order mark' if utf16 else ''}); "
                         "save the file as UTF-8") from None


def _folder(path: str | Path) -> Path | None:
    """The folder of a data file (relative image paths start there); None for a builder entry."""
    path = Path(path).resolve()  # absolute: the engine may read the images from elsewhere
    return path.parent if path.is_file() else path if path.is_dir() else None


def _dict_column(record: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    value = record.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: column {name!r} must be an object/dict, got "
                         f"{type(value).__name__}")
    return value


def _messages(value: Any, prompt_key: str, where: str, may_be_empty: bool = False
              ) -> list[dict[str, Any]]:
    if may_be_empty and value in (None, []):  # an environment's task brings the prompt
        return []
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: column {prompt_key!r} must be a non-empty list of chat "
                         f"messages {{'role': ..., 'content': ...}}, got {type(value).__name__}; "
                         "set data.prompt_key to the column that holds them")
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: every message in {prompt_key!r} needs a string 'role'; "
                             f"got {message!r}")
        content = message.get("content")
        if isinstance(content, list) and any(
                isinstance(part, dict) and part.get("type") not in (None, "text", "image")
                for part in content):
            raise ValueError(f"{where}: a message in {prompt_key!r} has a "
                             f"{_non_text(content)!r} part; video and audio cannot reach a "
                             "policy yet (images can), so the row would train without it; keep "
                             "text and image parts only")
    # parquet structs carry every key of the column's schema; drop the ones this row left empty
    return [{key: val for key, val in message.items() if val is not None or key == "content"}
            for message in value]


def _non_text(content: list) -> str:
    return next(part.get("type") for part in content
                if isinstance(part, dict) and part.get("type") not in (None, "text", "image"))


def row_from_record(record: dict[str, Any], index: int, prompt_key: str = "prompt",
                    where: str = "row", base: Path | None = None, number: int | None = None
                    ) -> DatasetRow:
    """Validate one raw record and wrap it as a DatasetRow (uid left empty); errors name
    `where` and the row's `number` in its file (default: index); `base`: the data file's
    folder, where relative image paths start (ImageRowError: the row's images)."""
    where = f"{where} {index if number is None else number}"
    task = record.get("task") is not None  # a verifiers environment's task brings the prompt
    if prompt_key not in record and not task:
        raise ValueError(f"{where}: no column {prompt_key!r} (data.prompt_key); columns are "
                         f"{sorted(record)}")
    extra_info = _dict_column(record, "extra_info", where)
    reward_model = _dict_column(record, "reward_model", where)
    # parquet gives every row every column, so "absent" and "null" mean the same here
    ground_truth = record.get("ground_truth")
    if ground_truth is None:
        ground_truth = reward_model.get("ground_truth")
    tools_kwargs = (_dict_column(record, "tools_kwargs", where)
                    or _dict_column(extra_info, "tools_kwargs", where))
    interaction_kwargs = (_dict_column(record, "interaction_kwargs", where)
                          or _dict_column(extra_info, "interaction_kwargs", where))
    if record.get("videos") not in (None, [], ""):  # refused, never silently dropped
        raise ValueError(f"{where}: column 'videos' holds videos, but video cannot reach a "
                         "policy yet (images can), so the row would train without them; drop "
                         "the column or the row")
    rollout_n = record.get("rollout_n")
    if rollout_n is not None and (isinstance(rollout_n, bool) or not isinstance(rollout_n, int)
                                  or rollout_n < 1):
        raise ValueError(f"{where}: rollout_n must be an integer >= 1, got {rollout_n!r}")
    do_sample = record.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"{where}: do_sample must be true or false, got {do_sample!r}")
    messages, images = _messages(record.get(prompt_key), prompt_key, where, task), []
    if record.get("images") not in (None, [], "") or image_parts(messages):
        messages, images = row_images(record, messages, where, base)
    return DatasetRow(messages=messages, index=index, images=images,
                      data_source=str(record.get("data_source") or ""), ground_truth=ground_truth,
                      reward_model=reward_model, extra_info=extra_info, tools_kwargs=tools_kwargs,
                      interaction_kwargs=interaction_kwargs, rollout_n=rollout_n,
                      do_sample=do_sample, raw=dict(record))


class PromptDataset:
    """Rows of one or more files, validated at load, handed out with a fresh uid each time.
    check_row(row) returns what is wrong with a row for its consumer (e.g. its reward), or None."""

    def __init__(self, files: Sequence[str | Path], prompt_key: str = "prompt",
                 check_row: Callable[[DatasetRow], str | None] | None = None) -> None:
        if isinstance(files, (str, Path)):
            files = [files]
        if not files:
            raise ValueError("PromptDataset needs at least one file (data.train_files / "
                             "data.val_files)")
        self.rows: list[DatasetRow] = []
        self.origins: list[str] = []  # "file: row N" of each row, for messages
        self.skipped: list[str] = []  # rows left out for their images, each with the reason
        for path in files:
            for number, record in enumerate(read_records(path)):
                try:
                    row = row_from_record(record, len(self.rows), prompt_key,
                                          where=f"{path}: row", base=_folder(path), number=number)
                except ImageRowError as error:  # that row's images: the others still load
                    logger.warning("left out: %s", error)
                    self.skipped.append(str(error))
                    continue
                problem = check_row(row) if check_row is not None else None
                if problem:
                    raise ValueError(f"{path}: row {number}: {problem}")
                self.rows.append(row)
                self.origins.append(f"{path}: row {number}")
        if not self.rows:
            raise ValueError(f"dataset files {list(map(str, files))} hold no rows"
                             + (f"; left out for their images: {self.skipped}" if self.skipped
                                else ""))

    @classmethod
    def from_config(cls, config: DataConfig, split: str = "train",
                    check_row: Callable[[DatasetRow], str | None] | None = None
                    ) -> "PromptDataset":
        """The train or val dataset named in the data config."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return cls(config.train_files if split == "train" else config.val_files, config.prompt_key,
                   check_row)

    def __len__(self) -> int:
        return len(self.rows)

    def drop(self, positions: Sequence[int]) -> None:
        """Remove the rows at these positions (e.g. prompts too long for the run)."""
        gone = set(positions)
        kept = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in kept]
        self.origins = [self.origins[i] for i in kept]

    def __getitem__(self, index: int) -> DatasetRow:
        """A copy of row `index` with a new uid (the same prompt drawn twice is two groups)."""
        row = self.rows[index]
        return DatasetRow(**{**row.__dict__, "uid": uuid.uuid4().hex})

    def _order(self, epoch: int, shuffle: bool, seed: int) -> list[int]:
        order = list(range(len(self.rows)))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order

    def batches(self, batch_size: int, epoch: int = 0, shuffle: bool = False, seed: int = 0,
                drop_last: bool = False) -> Iterator[list[DatasetRow]]:
        """Batches of one epoch; shuffled by (seed, epoch); batch_size 0 means all rows."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0 (0: all rows), got {batch_size}")
        order = self._order(epoch, shuffle, seed)
        size = batch_size or len(order)
        for start in range(0, len(order), size):
            chunk = order[start:start + size]
            if drop_last and len(chunk) < size:
                return
            yield [self[i] for i in chunk]

    def batch_at(self, batch_size: int, epoch: int, index: int, shuffle: bool = False,
                 seed: int = 0) -> list[DatasetRow]:
        """Batch `index` of `batches(batch_size, epoch, shuffle, seed)`, without drawing the others."""
        if batch_size < 1 or not 0 <= index < len(self.rows) // batch_size:
            raise IndexError(f"no full batch {index} of size {batch_size} in {len(self.rows)} rows")
        order = self._order(epoch, shuffle, seed)
        return [self[i] for i in order[index * batch_size:(index + 1) * batch_size]]
