"""The edits docs/researcher.md documents for upstream training scripts, applied to upstream's bytes.

`convert` is the researcher's part: the lines the docs tell them to change.
`on_cpu` is this machine's part: it has no GPU, so the moves to a GPU index
become moves to the CPU (and minGPT's "needs 2 GPUs" check is passed by).
Nothing else of upstream's files changes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parent / "upstream"

# An edit: (upstream line, what replaces it); [] deletes it, the line itself first keeps it and adds after it.
Edit = tuple[str, list[str]]


@dataclass(frozen=True)
class Script:
    folder: Path
    sha256: dict[str, str]
    edits: dict[str, tuple[Edit, ...]]            # file -> the documented edits
    no_gpu_here: dict[str, tuple[tuple[str, str], ...]]

    def convert(self, name: str, *, skip: str | None = None) -> str:
        """File `name` with each documented edit applied (but the one whose line contains `skip`)."""
        lines = (self.folder / name).read_text().splitlines()
        for old, new in self.edits.get(name, ()):
            if skip is not None and skip in old:
                continue
            at = [i for i, line in enumerate(lines) if line == old]
            assert len(at) == 1, f"{name}: upstream line {old!r} found {len(at)} times"
            lines[at[0]:at[0] + 1] = new
        return "\n".join(lines) + "\n"

    def on_cpu(self, name: str, source: str) -> str:
        for old, new in self.no_gpu_here.get(name, ()):
            assert old in source, (name, old)
            source = source.replace(old, new)
        return source

    def write_converted(self, into: Path, *, skip: str | None = None) -> Path:
        """Every file of the script, converted and moved to the CPU, in `into`."""
        into.mkdir(parents=True, exist_ok=True)
        for name in self.sha256:
            (into / name).write_text(self.on_cpu(name, self.convert(name, skip=skip)))
        return into

    def diff(self) -> str:
        """The documented edits as a unified diff, file by file (what docs/researcher.md shows)."""
        out: list[str] = []
        for name in self.edits:
            before = (self.folder / name).read_text()
            out += difflib.unified_diff(before.splitlines(), self.convert(name).splitlines(), name,
                                        f"{name} (elastic)", n=0, lineterm="")
        return "\n".join(out)

    def lines_touched(self) -> int:
        """Lines added, deleted or edited over all files (an edited line counts once)."""
        return sum(lines_touched((self.folder / name).read_text(), self.convert(name)) for name in self.edits)


def lines_touched(before: str, after: str) -> int:
    """Lines added, deleted or edited from `before` to `after` (an edited line counts once)."""
    matcher = difflib.SequenceMatcher(a=before.splitlines(), b=after.splitlines(), autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")


DDP_TUTORIAL = Script(
    folder=UPSTREAM / "ddp-tutorial-series",
    sha256={"multigpu_torchrun.py": "6b0a1568337fe206fa74e971cfeec42317f40b82122475327d50f0a0d37e1ba7",
            "datautils.py": "6af257501c49d1373b9b57f47e54ec9260eef7d97ad46b59cd0280cbbd6cc779"},
    edits={"multigpu_torchrun.py": (
        ("from torch.distributed import init_process_group, destroy_process_group",
         ["from torch.distributed import init_process_group, destroy_process_group",
          "from slurm_elastic.train import ElasticLoop"]),
        ("        if os.path.exists(snapshot_path):", []),
        ('            print("Loading snapshot")', []),
        ("            self._load_snapshot(snapshot_path)", []),
        ("        self.model = DDP(self.model, device_ids=[self.gpu_id])", []),
        ("    ddp_setup()", ["    loop = ElasticLoop(global_batch=4 * batch_size, every_steps=10)"]),
        ("    train_data = prepare_dataloader(dataset, batch_size)",
         ["    train_data = prepare_dataloader(dataset, batch_size)",
          "    model, optimizer, train_data = loop.prepare(model, optimizer, train_data)"]),
        ("    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)",
         ["    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)",
          "    trainer.epochs_run = loop.epochs_done"]),
        ("    destroy_process_group()", ["    loop.close()"]),
        # One writer per job, not per node: on a shared file system two nodes' writes tear the export.
        ("            if self.gpu_id == 0 and epoch % self.save_every == 0:",
         ['            if int(os.environ["RANK"]) == 0 and epoch % self.save_every == 0:']),
    )},
    no_gpu_here={"multigpu_torchrun.py": ((".to(self.gpu_id)", '.to("cpu")'),)},
)

MINGPT = Script(
    folder=UPSTREAM / "minGPT-ddp" / "mingpt",
    sha256={"main.py": "76ed1d0d9af85b774e4712acffda141f3267fbdb2e7b076daa6a8e08e40ae82a",
            "trainer.py": "70d823cf140a04181206941f425797daa6acde7da401c8b4536332e6e3ddde74",
            "model.py": "5e25ce645ebdd6d1e71b69fda809b3756a1640ae784694a584ec29e9053c566b",
            "char_dataset.py": "076f29ea3de531a0ab6c2a8b2039e82f4f4c6507dfe2b9b580049caa38b82461",
            "gpt2_train_cfg.yaml": "277bcd7c85f3afc69c5de5fca89631d9d6012e6daf4bb4b233196419dff51b04"},
    edits={
        "main.py": (
            ("from torch.distributed import init_process_group, destroy_process_group",
             ["from torch.distributed import init_process_group, destroy_process_group",
              "from slurm_elastic.train import ElasticLoop"]),
            ("    ddp_setup()",
             ["    loop = ElasticLoop(global_batch=4 * cfg['trainer_config']['batch_size'], every_steps=10)"]),
            ("    trainer = Trainer(trainer_cfg, model, optimizer, train_data, test_data)",
             ["    trainer = Trainer(trainer_cfg, model, optimizer, train_data, test_data)",
              "    trainer.model, trainer.optimizer, trainer.train_loader = loop.prepare("
              "trainer.model, trainer.optimizer, trainer.train_loader)",
              "    trainer.epochs_run = loop.epochs_done"]),
            ("    destroy_process_group()", ["    loop.close()"]),
        ),
        "trainer.py": (
            ("        self._load_snapshot()", []),
            ("        self.model = DDP(self.model, device_ids=[self.local_rank])", []),
            ("            if self.local_rank == 0 and epoch % self.save_every == 0:",
             ["            if self.global_rank == 0 and epoch % self.save_every == 0:"]),
        ),
    },
    no_gpu_here={
        "main.py": (("    if not verify_min_gpu_count(min_gpus=_min_gpu_count):", "    if False:"),),
        "trainer.py": (("torch.accelerator.current_accelerator()", '"cpu"'),
                       (".to(self.local_rank)", '.to("cpu")')),
    },
)
