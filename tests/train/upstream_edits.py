"""The edits docs/researcher.md documents for PyTorch's own `multigpu_torchrun.py`, applied to upstream's bytes.

`convert` is the researcher's part: the lines the docs tell them to change.
`on_cpu` is this machine's part: it has no GPU, so the `.to(<gpu index>)`
moves become `.to("cpu")`. Nothing else of upstream's file changes.
"""

from __future__ import annotations

import difflib
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parent / "upstream" / "ddp-tutorial-series"
TUTORIAL = UPSTREAM / "multigpu_torchrun.py"
SHA256 = {"multigpu_torchrun.py": "6b0a1568337fe206fa74e971cfeec42317f40b82122475327d50f0a0d37e1ba7",
          "datautils.py": "6af257501c49d1373b9b57f47e54ec9260eef7d97ad46b59cd0280cbbd6cc779"}

# (upstream line, what replaces it): [] deletes it; the line itself first keeps it and adds after it.
EDITS: tuple[tuple[str, list[str]], ...] = (
    ("from torch.distributed import init_process_group, destroy_process_group",
     ["from torch.distributed import init_process_group, destroy_process_group",
      "from slurm_elastic.train import ElasticLoop"]),
    ("        if os.path.exists(snapshot_path):", []),
    ('            print("Loading snapshot")', []),
    ("            self._load_snapshot(snapshot_path)", []),
    ("        self.model = DDP(self.model, device_ids=[self.gpu_id])", []),
    ("        b_sz = len(next(iter(self.train_data))[0])", ["        b_sz = self.train_data.batch_size"]),
    ("    ddp_setup()", ["    loop = ElasticLoop(global_batch=4 * batch_size, every_steps=10)"]),
    ("    train_data = prepare_dataloader(dataset, batch_size)",
     ["    train_data = prepare_dataloader(dataset, batch_size)",
      "    model, optimizer, train_data = loop.prepare(model, optimizer, train_data)"]),
    ("    destroy_process_group()", ["    loop.close()"]),
)
NO_GPU_HERE = ((".to(self.gpu_id)", '.to("cpu")'),)


def convert(source: str, edits: tuple[tuple[str, list[str]], ...] = EDITS) -> str:
    """`source` with each documented edit applied; each edited line must occur exactly once."""
    lines = source.splitlines()
    for old, new in edits:
        at = [i for i, line in enumerate(lines) if line == old]
        assert len(at) == 1, f"upstream line {old!r} found {len(at)} times"
        lines[at[0]:at[0] + 1] = new
    return "\n".join(lines) + "\n"


def on_cpu(source: str) -> str:
    for old, new in NO_GPU_HERE:
        assert old in source, old
        source = source.replace(old, new)
    return source


def unified_diff(before: str, after: str) -> list[str]:
    return list(difflib.unified_diff(before.splitlines(), after.splitlines(), "multigpu_torchrun.py",
                                     "multigpu_torchrun.py (elastic)", n=0, lineterm=""))


def lines_touched(before: str, after: str) -> int:
    """Lines of the script added, deleted or edited (an edited line counts once)."""
    matcher = difflib.SequenceMatcher(a=before.splitlines(), b=after.splitlines(), autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")


def write_converted(into: Path, *, peek_edit: bool = True) -> Path:
    """The converted tutorial (CPU moves applied) and upstream's datautils.py, in `into`."""
    edits = EDITS if peek_edit else tuple(e for e in EDITS if "next(iter(" not in e[0])
    into.mkdir(parents=True, exist_ok=True)
    (into / "multigpu_torchrun.py").write_text(on_cpu(convert(TUTORIAL.read_text(), edits)))
    (into / "datautils.py").write_bytes((UPSTREAM / "datautils.py").read_bytes())
    return into
