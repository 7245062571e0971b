"""The reference's log-probs: from the frozen reference model on each batch (`LiveReference`), or computed once and
kept on disk (`CachedReference`, `fill`), so that training runs no reference forward pass.

One file per reference and way of computing it: `<cache_dir>/reference_logps/<weights digest>-<computation
digest>.pt`, holding the summed log-prob of each response of each pair, keyed by the digest of the pair's token ids
that comes with the tokenized data (tokenized.example_keys: prompt and responses, after truncation). Tokenizer, data
and truncation settings all change those ids, so a pair computed under other settings is simply absent and gets
computed. The computation names everything that changes the rounding of the numbers (precision, layout, trainer and
ranks, micro-batch sizes, data order): a run that computes like the one that filled the cache (a resume, a sweep over
beta or lr) finds numbers equal to its own initial policy's to the last bit. A file whose contents do not match its
name is never used: it is recomputed, and a line says why.

The entries are two arrays, sorted keys and their log-probs (`ReferenceTable`: 24 bytes a pair), loaded
memory-mapped and looked up by binary search: a million pairs load in milliseconds and take 24 MB.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import tqdm

import storage
from core.layouts import to_device
from modeling import weights
from utils import UserError, first_line

if TYPE_CHECKING:
    from core.examples import Examples
    from core.scoring import Scorer
    from modeling.distributed import Topology

FORMAT = 2


def weights_digest(model: torch.nn.Module, topology: "Topology") -> str:
    """sha256 of every rank's digest of its shards of the model's weights (weights.local_digest), in rank order: the
    same on every rank, and no rank ever holds the whole model. It names the weights as sharded on this mesh, which the
    cache's other key (the computation) names anyway."""
    return hashlib.sha256("".join(topology.all_gather(weights.local_digest(model))).encode()).hexdigest()


@dataclass
class ReferenceTable:
    """Reference log-probs by pair key. keys: [n] S16, sorted and distinct; logps: [n, R] float32."""

    keys: np.ndarray
    logps: np.ndarray

    @staticmethod
    def of(keys, logps) -> "ReferenceTable":
        """The table of these entries; a key given twice keeps its last log-probs."""
        keys, logps = np.asarray(keys, dtype="S16"), np.asarray(logps, dtype=np.float32)
        order = np.argsort(keys, kind="stable")[::-1]  # the last of equal keys first
        keys, logps = keys[order], logps[order]
        _, first = np.unique(keys, return_index=True)
        return ReferenceTable(keys[first], logps[first].reshape(len(first), -1))

    def __len__(self) -> int:
        return len(self.keys)

    def positions(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """(where each key is, whether it is there)."""
        keys = np.asarray(keys, dtype="S16")
        where = np.minimum(np.searchsorted(self.keys, keys), max(len(self.keys) - 1, 0))
        found = self.keys[where] == keys if len(self.keys) else np.zeros(len(keys), bool)
        return where, found

    def missing(self, keys) -> np.ndarray:
        """[k] bool: which keys have no entry."""
        return ~self.positions(keys)[1]

    def lookup(self, keys) -> np.ndarray:
        """[k, R] the log-probs of each key; KeyError where one has none."""
        where, found = self.positions(keys)
        if not found.all():
            raise KeyError(f"{int((~found).sum())} keys have no reference log-probs")
        return self.logps[where]

    def merged(self, keys, logps) -> "ReferenceTable":
        """This table with these entries added (or replaced)."""
        if not len(self):
            return ReferenceTable.of(keys, logps)
        return ReferenceTable.of(np.concatenate([self.keys, keys]), np.concatenate([self.logps, logps]))


def cache_path(cache_dir: Path, weights: str, computation: str) -> Path:
    return cache_dir / "reference_logps" / f"{weights[:20]}-{hashlib.sha1(computation.encode()).hexdigest()[:12]}.pt"


def load(path: Path, weights: str, computation: str) -> tuple[ReferenceTable, str | None]:
    """(entries, why they were discarded or None), the arrays memory-mapped. A missing file is an empty cache, not
    a problem."""
    empty = ReferenceTable(np.zeros(0, "S16"), np.zeros((0, 2), np.float32))
    if not path.exists():
        return empty, None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        header = {key: saved[key] for key in ("format", "weights", "computation")}
        keys, logps = saved["keys"], saved["logps"]
    except Exception as error:  # unreadable or truncated: recompute rather than stop the run
        return empty, f"{path} is unreadable ({first_line(error)})"
    expected = {"format": FORMAT, "weights": weights, "computation": computation}
    wrong = [f"{key} {header[key]!r}, expected {value!r}" for key, value in expected.items() if header[key] != value]
    if wrong:
        return empty, f"{path} was made for another reference ({'; '.join(wrong)})"
    well_formed = (
        torch.is_tensor(keys)
        and torch.is_tensor(logps)
        and keys.dtype == torch.uint8
        and keys.dim() == 2
        and keys.shape[1] == 16
        and logps.dim() == 2
        and logps.shape[0] == keys.shape[0]
    )
    if not well_formed or not torch.isfinite(logps).all():
        return empty, f"{path} holds malformed log-probs"
    keys = keys.numpy().view("S16").reshape(-1)
    if len(keys) > 1 and not (keys[1:] > keys[:-1]).all():
        return empty, f"{path} holds unsorted keys"
    return ReferenceTable(keys, logps.numpy()), None


def save(path: Path, weights: str, computation: str, table: ReferenceTable) -> None:
    """Write atomically: a crash leaves the previous file or the new one, never half of one. A failure to write is
    one line: the run goes on with the log-probs it holds, uncached."""
    try:
        with storage.writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
        write(path, weights, computation, table)
    except storage.WriteFailed as error:
        print(f"reference log-probs: not cached ({error}); this run goes on with them in memory")


def write(path: Path, weights: str, computation: str, table: ReferenceTable) -> None:
    state = {
        "format": FORMAT,
        "weights": weights,
        "computation": computation,
        "keys": torch.from_numpy(np.ascontiguousarray(table.keys).view(np.uint8).reshape(-1, 16).copy()),
        "logps": torch.from_numpy(np.ascontiguousarray(table.logps, dtype=np.float32)),
    }
    with storage.replaced(path) as tmp:
        torch.save(state, tmp)


class LiveReference:
    """The frozen reference model, run on each batch without gradients."""

    live = True  # a forward pass per batch

    def __init__(self, model: torch.nn.Module, scorer: "Scorer", compute: torch.dtype | None):
        self.model, self.scorer, self.compute = model, scorer, compute

    @torch.no_grad()
    def __call__(self, examples: list[dict], batch) -> torch.Tensor:
        """[R * B] log-probs, ordered like the policy's."""
        return self.scorer(self.model, batch, self.compute)


class CachedReference:
    """Log-probs looked up by pair key."""

    live = False

    def __init__(self, table: ReferenceTable, device: torch.device):
        self.table, self.device = table, device

    def require(self, keys: np.ndarray) -> None:
        """A one-line error unless every key's log-probs are here (a new round's data: the cache holds the pairs the
        run was built with)."""
        keys = np.unique(np.asarray(keys, dtype="S16"))
        missing = int(self.table.missing(keys).sum())
        if missing:
            raise UserError(
                f"{missing} of these {len(keys)} pairs have no cached reference log-probs: the cache holds the "
                "pairs the run was built with; build the round's reference first, or use reference_cache=false"
            )

    def __call__(self, examples: list[dict], batch) -> torch.Tensor:
        """[R * B] log-probs, ordered like the policy's: [B, R] per pair, transposed; looked up on the host and
        sent with the batch (asynchronously to a GPU)."""
        logps = self.table.lookup([ex["key"] for ex in examples])
        return to_device(torch.from_numpy(logps.T.reshape(-1).copy()), self.device)


def fill(
    path: Path,
    weights: str,
    computation: str,
    train: "Examples",
    first_use: list[int],
    batches: list[tuple[list[dict], int]],
    batch_size: int,
    accumulation: int,
    load_model: Callable[[], tuple],
    scorer: "Scorer",
    topology: "Topology",
) -> ReferenceTable:
    """Reference log-probs of the training examples at `first_use` (indices, in the order training first uses them)
    and of the examples of `batches` ((examples, the batch size they are cut by): the eval batches, KTO's mismatched
    examples), by pair key: from the file where it has them; the others are computed now, in batches of
    batch_size (the training examples) or their own, cut into the run's micro-batches, and added to it.
    load_model() gives (model, compute dtype), called only if any is missing."""
    table, why = topology.run_on_main(lambda: load(path, weights, computation)) or (None, None)
    table = topology.broadcast(table)
    if why:
        print(f"reference log-probs: recomputing, since {why}")
    first_use = np.asarray(first_use, dtype=np.int64)
    eval_keys = np.array([ex["key"] for batch, _ in batches for ex in batch], dtype="S16")
    needed = len(np.unique(np.concatenate([train.keys[first_use], eval_keys])))
    train_missing = first_use[table.missing(train.keys[first_use])]
    evals = [([ex for ex in batch if table.missing([ex["key"]])[0]], size) for batch, size in batches]
    evals = [(batch, size) for batch, size in evals if batch]
    missing_keys = [train.keys[train_missing], np.array([ex["key"] for b, _ in evals for ex in b], dtype="S16")]
    missing = len(np.unique(np.concatenate(missing_keys)))
    if not missing:
        print(f"reference log-probs: all {needed} pairs from {path}")
        return table
    print(f"reference log-probs: computing {missing} of {needed} pairs, then caching them in {path}")
    model, compute = load_model()
    mode = model.training
    model.eval()
    size = batch_size
    groups = [(train_missing[i : i + size], size) for i in range(0, len(train_missing), size)]
    groups += evals
    progress = tqdm.tqdm(
        total=len(train_missing) + sum(len(batch) for batch, _ in evals),
        desc="reference log-probs",
        unit="pair",
        disable=not topology.is_main,
    )
    keys, computed = [], []
    with torch.no_grad():
        for examples, size in groups:
            examples = train.take(examples) if isinstance(examples, np.ndarray) else examples
            micro, _ = topology.micro_batches(examples, size, accumulation)
            # [R * b] per micro-batch -> [R, b]: each response of each pair, in the rank's order
            logps = torch.cat([scorer(model, scorer.batch(mb), compute).view(-1, len(mb)) for mb in micro], dim=1)
            computed.append(topology.gather_columns(logps, len(examples)).T.cpu().numpy())  # [n, R], batch order
            keys += [ex["key"] for ex in examples]
            progress.update(len(examples))
    progress.close()
    model.train(mode)
    table = table.merged(np.array(keys, dtype="S16"), np.concatenate(computed))
    if topology.is_main:
        save(path, weights, computation, table)
    return table
