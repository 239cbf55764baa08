"""Installing job_submit.lua: copy it beside slurm.conf and enable JobSubmitPlugins=lua."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from slurm_elastic.errors import ElasticError, SpecError

_PLUGINS_RE = re.compile(r"^(\s*JobSubmitPlugins\s*=\s*)(\S*)(.*)$", re.IGNORECASE | re.MULTILINE)


def lua_source() -> str:
    return resources.files("slurm_elastic").joinpath("data", "job_submit.lua").read_text()


UNIT_ENTRY_POINT = "@SLURM_ELASTIC@"


def unit_file_source(entry_point: Path | None = None) -> str:
    """The systemd unit, its ExecStart the absolute path of `entry_point` (default: this installation's)."""
    entry = entry_point or installed_entry_point()
    if not entry.is_absolute():
        raise ElasticError(f"the unit's ExecStart must be an absolute path, not {entry}")
    text = resources.files("slurm_elastic").joinpath("data", "slurm-elastic.service").read_text()
    return text.replace(UNIT_ENTRY_POINT, str(entry))


def installed_entry_point() -> Path:
    """The `slurm-elastic` script beside the interpreter running now (a venv's or a prefix's bin/)."""
    import sys

    return Path(sys.executable).parent / "slurm-elastic"


@dataclass(frozen=True, slots=True)
class PluginChange:
    """What installing the plugin changes (printed before, or instead of, doing it)."""

    lua_path: Path
    lua_action: str           # "create", "replace" or "unchanged"
    conf_path: Path
    conf_before: str | None   # the JobSubmitPlugins line, None if absent
    conf_after: str | None    # None: slurm.conf is left as it is

    def lines(self) -> list[str]:
        out = [f"{self.lua_action} {self.lua_path}"]
        if self.conf_after is None:
            out.append(f"unchanged {self.conf_path} ({self.conf_before.strip() if self.conf_before else ''})")
        elif self.conf_before is None:
            out.append(f"append to {self.conf_path}: {self.conf_after}")
        else:
            out.append(f"change in {self.conf_path}: {self.conf_before.strip()} -> {self.conf_after}")
        return out


def plan_install(slurm_conf: str | os.PathLike[str]) -> PluginChange:
    conf = Path(slurm_conf)
    if not conf.is_file():
        raise SpecError(f"--slurm-conf {conf}: no such file")
    try:
        text = conf.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"--slurm-conf {conf}: not a readable slurm.conf ({exc})") from None
    # Slurm reads job_submit.lua from the directory that holds slurm.conf.
    lua_path = conf.parent / "job_submit.lua"
    if lua_path.exists():
        lua_action = "unchanged" if lua_path.read_text() == lua_source() else "replace"
    else:
        lua_action = "create"
    m = _PLUGINS_RE.search(text)
    if m is None:
        return PluginChange(lua_path, lua_action, conf, None, "JobSubmitPlugins=lua")
    plugins = [p for p in m[2].split(",") if p]
    if any(p.lower() in ("lua", "job_submit/lua") for p in plugins):
        return PluginChange(lua_path, lua_action, conf, m[0], None)
    return PluginChange(lua_path, lua_action, conf, m[0], f"{m[1].strip()}{','.join(plugins + ['lua'])}")


def apply_install(change: PluginChange) -> None:
    try:
        if change.lua_action != "unchanged":
            tmp = change.lua_path.with_name(".job_submit.lua.tmp")
            tmp.write_text(lua_source())
            os.chmod(tmp, 0o644)
            os.replace(tmp, change.lua_path)
        if change.conf_after is not None:
            text = change.conf_path.read_text()
            shutil.copy2(change.conf_path, change.conf_path.with_name(change.conf_path.name + ".slurm-elastic.bak"))
            if change.conf_before is None:
                text = text.rstrip("\n") + "\n" + change.conf_after + "\n"
            else:
                text = text.replace(change.conf_before, change.conf_after, 1)
            tmp = change.conf_path.with_name("." + change.conf_path.name + ".tmp")
            tmp.write_text(text)
            shutil.copymode(change.conf_path, tmp)
            os.replace(tmp, change.conf_path)
    except PermissionError as exc:
        raise ElasticError(f"cannot write {exc.filename}: permission denied (run as root or the owner "
                           "of slurm.conf)") from None
