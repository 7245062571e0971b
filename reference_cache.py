"""Reference log-probs computed once and kept on disk, so that training runs no reference forward pass.

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

import torch

from utils import first_line

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
