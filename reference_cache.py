"""The reference's log-probs: from the frozen reference model on each batch (`LiveReference`), or computed once and
kept on disk (`CachedReference`, `fill`), so that training runs no reference forward pass.

One file per reference and way of computing it: `<cache_dir>/reference_logps/<weights digest>-<computation
digest>.pt`, holding the summed log-prob of each response of each pair, keyed by a digest of the pair's token ids
(prompt and responses, after truncation). Tokenizer, data and truncation settings all change those ids, so a pair
computed under other settings is simply absent and gets computed. The computation names everything that changes
the rounding of the numbers (precision, layout, trainer and ranks, micro-batch sizes, data order): a run that
computes like the one that filled the cache (a resume, a sweep over beta or lr) finds numbers equal to its own
initial policy's to the last bit. A file whose contents do not match its name is never used: it is recomputed,
and a line says why.
"""

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import tqdm

from layouts import to_device
from utils import UserError, first_line

if TYPE_CHECKING:
    from distributed import Topology
    from scoring import Scorer

FORMAT = 1


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's parameter and buffer names, dtypes, shapes and values."""
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        value = value.detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.view(-1).view(torch.uint8).numpy())  # the tensor's own buffer: no copy
    return digest.hexdigest()


def pair_key(example: dict) -> str:
    """Digest of a tokenized example's prompt and responses: what the reference log-probs depend on."""
    text = repr((example["prompt"], example["responses"]))
    return hashlib.sha1(text.encode()).hexdigest()


def cache_path(cache_dir: Path, weights: str, computation: str) -> Path:
    return cache_dir / "reference_logps" / f"{weights[:20]}-{hashlib.sha1(computation.encode()).hexdigest()[:12]}.pt"


def load(path: Path, weights: str, computation: str) -> tuple[dict[str, list[float]], str | None]:
    """(entries, why they were discarded or None). A missing file is an empty cache, not a problem."""
    if not path.exists():
        return {}, None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        header = {key: saved[key] for key in ("format", "weights", "computation")}
        keys, logps = saved["keys"], saved["logps"]
    except Exception as error:  # unreadable or truncated: recompute rather than stop the run
        return {}, f"{path} is unreadable ({first_line(error)})"
    expected = {"format": FORMAT, "weights": weights, "computation": computation}
    wrong = [f"{key} {header[key]!r}, expected {value!r}" for key, value in expected.items() if header[key] != value]
    if wrong:
        return {}, f"{path} was made for another reference ({'; '.join(wrong)})"
    if not torch.is_tensor(logps) or logps.shape[0] != len(keys) or not torch.isfinite(logps).all():
        return {}, f"{path} holds malformed log-probs"
    return dict(zip(keys, logps.tolist())), None


def save(path: Path, weights: str, computation: str, entries: dict[str, list[float]]) -> None:
    """Write atomically: a crash leaves the previous file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(entries)
    state = {
        "format": FORMAT,
        "weights": weights,
        "computation": computation,
        "keys": keys,
        "logps": torch.tensor([entries[key] for key in keys], dtype=torch.float32),
    }
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    tmp.replace(path)


class LiveReference:
    """The frozen reference model, run on each batch without gradients."""

    def __init__(self, model: torch.nn.Module, scorer: "Scorer", compute: torch.dtype | None):
        self.model, self.scorer, self.compute = model, scorer, compute

    @torch.no_grad()
    def __call__(self, examples: list[dict], batch) -> torch.Tensor:
        """[R * B] log-probs, ordered like the policy's."""
        return self.scorer(self.model, batch, self.compute)


class CachedReference:
    """Log-probs looked up by pair key."""

    def __init__(self, entries: dict[str, list[float]], device: torch.device):
        self.entries, self.device = entries, device

    def require(self, examples: list[dict]) -> None:
        """A one-line error unless every example's log-probs are here (a new round's data: the cache holds the pairs
        the run was built with)."""
        keys = {ex["key"] for ex in examples}
        missing = keys - self.entries.keys()
        if missing:
            raise UserError(
                f"{len(missing)} of these {len(keys)} pairs have no cached reference log-probs: the cache holds the "
                "pairs the run was built with; build the round's reference first, or use reference_cache=false"
            )

    def __call__(self, examples: list[dict], batch) -> torch.Tensor:
        """[R * B] log-probs, ordered like the policy's: [B, R] per pair, transposed; looked up on the host and
        sent with the batch (asynchronously to a GPU)."""
        return to_device(torch.tensor([self.entries[ex["key"]] for ex in examples]).T.reshape(-1), self.device)


def fill(
    path: Path,
    weights: str,
    computation: str,
    train: list[dict],
    eval_batches: list[list[dict]],
    batch_sizes: tuple[int, int],
    accumulation: int,
    load_model: Callable[[], tuple],
    scorer: "Scorer",
    topology: "Topology",
) -> dict[str, list[float]]:
    """Reference log-probs of the `train` examples (in first-use order) and of the eval batches, by pair key: from
    the file where it has them; the others are computed now, in batches of batch_sizes (train, eval) cut into the
    run's micro-batches, and added to it. load_model() gives (model, compute dtype), called only if any is missing."""
    entries, why = topology.run_on_main(lambda: load(path, weights, computation)) or ({}, None)
    entries = topology.broadcast(entries)
    if why:
        print(f"reference log-probs: recomputing, since {why}")
    needed = len({ex["key"] for ex in train} | {ex["key"] for batch in eval_batches for ex in batch})
    train = [ex for ex in train if ex["key"] not in entries]
    evals = [batch for batch in ([ex for ex in batch if ex["key"] not in entries] for batch in eval_batches) if batch]
    missing = len({ex["key"] for ex in train} | {ex["key"] for batch in evals for ex in batch})
    if not missing:
        print(f"reference log-probs: all {needed} pairs from {path}")
        return entries
    print(f"reference log-probs: computing {missing} of {needed} pairs, then caching them in {path}")
    model, compute = load_model()
    mode = model.training
    model.eval()
    groups = [(train[i : i + batch_sizes[0]], batch_sizes[0]) for i in range(0, len(train), batch_sizes[0])]
    groups += [(batch, batch_sizes[1]) for batch in evals]
    progress = tqdm.tqdm(
        total=sum(len(examples) for examples, _ in groups),
        desc="reference log-probs",
        unit="pair",
        disable=not topology.is_main,
    )
    with torch.no_grad():
        for examples, size in groups:
            micro, _ = topology.micro_batches(examples, size, accumulation)
            # [R * b] per micro-batch -> [R, b]: each response of each pair, in the rank's order
            logps = torch.cat([scorer(model, scorer.batch(mb), compute).view(-1, len(mb)) for mb in micro], dim=1)
            gathered = topology.gather_columns(logps, len(examples)).T.cpu().tolist()  # [n, R], batch order
            entries.update(zip((ex["key"] for ex in examples), gathered))
            progress.update(len(examples))
    progress.close()
    model.train(mode)
    if topology.is_main:
        save(path, weights, computation, entries)
    return entries
