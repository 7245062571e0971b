"""Sources of preference data: the rows of a dataset name (hh, shp, se, demo, a local file or directory, or any Hub
dataset `org/name[:split]`) as one `Source` per split, each a stream of (location, row) items that it reads anew at
each call and a fingerprint of what they are. Local files are .jsonl, .jsonl.gz, .json or .parquet, their text in
the encoding a byte-order mark names, else UTF-8; the image paths of their rows are made absolute beside them."""

import codecs
import gzip
import hashlib
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from modeling.vision import IMAGE_COLUMNS, is_url
from utils import REPO_ROOT, UserError, first_line

HUB_DATASETS = {"hh": "Anthropic/hh-rlhf", "shp": "stanfordnlp/SHP", "se": "HuggingFaceH4/stack-exchange-preferences"}
DEMO_DIR = REPO_ROOT / "data" / "demo"
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
TEST_SPLIT_NAMES = ("test", "eval", "validation", "valid", "dev")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")  # org/name, optionally :split
# A byte-order mark opening a text file names its encoding (Windows editors, spreadsheet exports and PowerShell's `>`
# write one); without one, UTF-8. Longest first: UTF-32-LE's mark begins with UTF-16-LE's.
BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def text_encoding(head: bytes) -> tuple[str, str]:
    """(codec, name) of the text whose first bytes are `head`: the encoding its byte-order mark names, else UTF-8.
    The codec drops the mark."""
    codec = next((codec for mark, codec in BYTE_ORDER_MARKS if head.startswith(mark)), "utf-8")
    return codec, codec.removesuffix("-sig").upper()


def open_binary(path: Path):
    return gzip.open(path) if path.name.endswith(".gz") else open(path, "rb")


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, gzipped or not, in the encoding `text_encoding` finds. UTF-8 streams line
    by line; UTF-16 and UTF-32 (rarer, and their newlines are not single bytes) are decoded whole."""
    with open_binary(path) as f:
        codec, encoding = text_encoding(f.read(4))
    with open_binary(path) as f:
        if encoding == "UTF-8":
            for number, raw in enumerate(f, start=1):
                try:  # the mark (utf-8-sig) may open the file only
                    yield number, raw.decode(codec if number == 1 else "utf-8")
                except UnicodeDecodeError as error:
                    reason = f"{error.reason} at column {error.start}"
                    raise UserError(f"{path}:{number}: not UTF-8 text ({reason})") from None
            return
        data = f.read()
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as error:
        number = data[: error.start].decode(codec, errors="replace").count("\n") + 1
        raise UserError(f"{path}:{number}: not {encoding} text ({error.reason})") from None
    yield from enumerate(text.split("\n"), start=1)  # only "\n" ends a line: JSON strings may hold U+2028


def with_image_paths(row: Any, base: Path) -> Any:
    """The row with the image paths of its `images` / `image` column made absolute: relative ones are relative to
    the data file's directory (`base`). URLs stay URLs."""
    if not isinstance(row, dict) or not any(row.get(column) for column in IMAGE_COLUMNS):
        return row

    def resolved(cell):
        if isinstance(cell, str) and cell and not Path(cell).is_absolute() and not is_url(cell):
            return str(base / cell)
        if isinstance(cell, dict) and not cell.get("bytes") and isinstance(cell.get("path"), str):
            return {**cell, "path": resolved(cell["path"])}
        return cell

    row = dict(row)
    for column in IMAGE_COLUMNS:
        value = row.get(column)
        if value:
            row[column] = [resolved(cell) for cell in value] if isinstance(value, list) else resolved(value)
    return row


def read_file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, row) for each row of a .jsonl, .jsonl.gz, .json or .parquet file; text in UTF-8, or in the UTF-8,
    UTF-16 or UTF-32 that a byte-order mark opening the file names."""
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        try:
            for number, line in text_lines(path):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise UserError(f"{path}:{number}: malformed JSON line ({error.msg})") from None
                    yield f"{path}:{number}", with_image_paths(row, path.parent)
        except (EOFError, gzip.BadGzipFile, zlib.error) as error:
            raise UserError(f"{path}: a truncated or corrupt gzip file ({first_line(error)})") from None
    elif name.endswith(".json"):
        data = path.read_bytes()
        codec, encoding = text_encoding(data)
        try:
            rows = json.loads(data.decode(codec))
        except UnicodeDecodeError as error:
            raise UserError(f"{path}: not {encoding} text ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from None
        if not isinstance(rows, list):
            raise UserError(f"{path}: expected a JSON list of rows")
        for number, row in enumerate(rows, start=1):
            yield f"{path} row {number}", with_image_paths(row, path.parent)
    else:
        import pyarrow  # imported on use: only Parquet files need it (about 90 ms of start-up)
        import pyarrow.parquet

        number = 0
        try:  # a row group at a time: a file larger than memory streams through
            for batch in pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    number += 1
                    yield f"{path} row {number}", with_image_paths(row, path.parent)
        except (pyarrow.ArrowException, OSError) as error:
            raise UserError(f"{path}: not a readable Parquet file ({first_line(error)})") from None


def local_split_files(path: Path) -> dict[str, list[Path]]:
    """{"train": files, "test": files} of a file or directory; "test" is empty when it has no test split."""
    if path.is_file():
        if not path.name.endswith(FILE_SUFFIXES):
            raise UserError(f"{path}: unsupported file type; expected one of {', '.join(FILE_SUFFIXES)}")
        return {"train": [path], "test": []}
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(FILE_SUFFIXES))
    if not files:
        raise UserError(f"{path}: no {', '.join(FILE_SUFFIXES)} files in this directory")
    test = [p for p in files if p.name.lower().startswith(TEST_SPLIT_NAMES)]
    return {"train": [p for p in files if p not in test], "test": test}


def load_from_hub(name: str, repo: str, split: str | None, cache_dir: Path):
    """datasets.load_dataset(repo, split=split): a Dataset, or a DatasetDict of every split for split=None."""
    import datasets  # imported on use: only Hub datasets need it, and it adds about 2 s to every start

    try:
        return datasets.load_dataset(repo, cache_dir=str(cache_dir), split=split)
    except Exception as error:  # offline, missing, or gated: the datasets library raises many types
        shown = f"'{name}'" if name == repo else f"'{name}' ({repo})"
        raise UserError(
            f"could not load dataset {shown} from the Hugging Face Hub "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "give a local copy instead, e.g. datasets=[path/to/file.jsonl.gz]"
        ) from None


@dataclass
class Source:
    """One stream of rows, read as one: a file, a directory's train or test files, or a split of a Hub dataset."""

    label: str  # how the data lines name it
    rows: Callable[[], Iterator[tuple[str, Any]]]  # (location, row) items, read anew at each call
    fingerprint: Callable[[], str]  # what the rows are: each file's name and content digest, or the Hub dataset's own


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def files_source(label: str, files: list[Path]) -> Source:
    return Source(
        label,
        lambda: (item for file in files for item in read_file_rows(file)),
        lambda: " ".join(f"{file}:{file_digest(file)}{image_files_digest(file)}" for file in files),
    )


def image_files_digest(file: Path) -> str:
    """A digest of the image files a data file's rows name by path (none: ""): a changed image changes what its
    examples are, as a changed row does. Each file by its size and modification time, as make judges a file, not by
    its bytes: this runs at every start, and reading every image of a large set (RLAIF-V's 80k) each time would cost
    more than the cache saves. Examples' keys, which the reference cache reads, digest the bytes themselves."""
    if not file.name.endswith((".jsonl", ".jsonl.gz", ".json")) or b'"image' not in file_head(file):
        return ""
    digest, paths = hashlib.sha256(), 0
    for _, row in read_file_rows(file):
        cells = [row.get(column) for column in IMAGE_COLUMNS] if isinstance(row, dict) else []
        for cell in (cell for value in cells for cell in (value if isinstance(value, list) else [value])):
            path = cell.get("path") if isinstance(cell, dict) and not cell.get("bytes") else cell
            if isinstance(path, str) and Path(path).is_file():
                stat = Path(path).stat()
                digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
                paths += 1
    return f" images {digest.hexdigest()}" if paths else ""


def file_head(file: Path) -> bytes:
    """The start of a data file as stored, decompressed where it is gzip: enough to see its columns. A truncated or
    corrupt gzip file gives none: reading its rows says so in one line (read_file_rows)."""
    try:
        with open_binary(file) as stream:
            return stream.read(1 << 16)
    except (EOFError, gzip.BadGzipFile, zlib.error):
        return b""


def hub_source(data, label: str) -> Source:
    """The rows of a `datasets.Dataset`, fingerprinted by the datasets library (it changes with the data and with
    every transform applied to it)."""
    return Source(
        label, lambda: ((f"{label} row {i + 1}", row) for i, row in enumerate(data)), lambda: data._fingerprint
    )


def named_hub_split(name: str, split: str, cache_dir: Path) -> Source:
    """hh, shp or se: a split of the Hub dataset the DPO reference trained on."""
    hub_name = HUB_DATASETS[name]
    if name == "se":
        # SE has only a train split; the reference holds out its first 1% after a fixed shuffle as test.
        data = load_from_hub(name, hub_name, "train", cache_dir).shuffle(seed=42)
        cut = int(len(data) * 0.01)
        data = data.select(range(cut) if split == "test" else range(cut, len(data)))
    else:
        data = load_from_hub(name, hub_name, split, cache_dir)
    return hub_source(data, f"{hub_name}[{split}]")


def hub_sources(name: str, cache_dir: Path) -> dict[str, Source]:
    """Any Hub dataset `org/name` (its train split, and its test split where it has one) or `org/name:split`
    (that split only)."""
    repo, _, split = name.partition(":")
    data = load_from_hub(name, repo, split or None, cache_dir)
    if split:
        return {"train": hub_source(data, f"{repo}[{split}]")}
    if "train" not in data:
        raise UserError(f"{repo} has no 'train' split; choose one of {', '.join(data)} with {repo}:SPLIT")
    test = next((s for s in data if s.lower().startswith(TEST_SPLIT_NAMES)), None)
    named = {"train": "train"} | ({"test": test} if test else {})
    return {key: hub_source(data[s], f"{repo}[{s}]") for key, s in named.items()}


def dataset_sources(name: str, cache_dir: Path) -> dict[str, Source]:
    """{"train": source, and "test": source where the dataset has a test split} of a dataset name: hh, shp, se,
    demo, a local file or directory, or any Hub dataset `org/name[:split]`."""
    if name in HUB_DATASETS:
        return {split: named_hub_split(name, split, cache_dir) for split in ("train", "test")}
    path = DEMO_DIR if name == "demo" else Path(name)
    if path.exists():
        return {
            split: files_source(f"{path} ({split} files)" if path.is_dir() else str(path), files)
            for split, files in local_split_files(path).items()
            if files
        }
    if HUB_ID.match(name) and not name.endswith(FILE_SUFFIXES):
        return hub_sources(name, cache_dir)
    raise UserError(
        f"unknown dataset '{name}': expected one of {', '.join([*HUB_DATASETS, 'demo'])}, a Hub dataset "
        f"org/name[:split], or an existing {'/'.join(FILE_SUFFIXES)} file or directory"
    )
