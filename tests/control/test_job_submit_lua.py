"""job_submit.lua accepts exactly the comments ElasticSpec.from_comment accepts (run with the lua binary)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_elastic.control.plugin import lua_source
from slurm_elastic.errors import SpecError
from slurm_elastic.spec import ElasticSpec

LUA = shutil.which("lua5.1") or shutil.which("lua5.3") or shutil.which("lua")
HARNESS = """
slurm = {SUCCESS=0, ERROR=-1, log_user=function(...) end, log_info=function(...) end}
dofile(arg[1])
for line in io.lines(arg[2]) do
  if elastic_spec_error(line) == nil then print("OK") else print("BAD") end
end
"""

pytestmark = pytest.mark.skipif(LUA is None, reason="no lua interpreter installed")

SAMPLES = [
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",
    "elastic:v1 gpus=4-32 step=4 cpus-per-gpu=8 mem-per-gpu=65536M weight=0.5 ckpt=/scratch/a_b/c-d+e@f.g",
    "elastic:v1 gpus=01-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",
    "elastic:v1 gpus=4-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",
    "elastic:v1 gpus=2-6 step=4 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1.0",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=0",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 ckpt=relative",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 ckpt=/a/../b",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 extra=1",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1;rm -rf /",
    "elastic:v1 gpus=1-200000 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=2000 mem-per-gpu=1024M weight=1",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1000001",
    "elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=0.1234567",
    "elastic:v1  gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",
]


def _python_accepts(text: str) -> bool:
    try:
        ElasticSpec.from_comment(text)
    except SpecError:
        return False
    return True


def _lua_accepts(tmp_path, lines: list[str]) -> list[bool]:
    (tmp_path / "plugin.lua").write_text(lua_source())
    (tmp_path / "harness.lua").write_text(HARNESS)
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    out = subprocess.run([LUA, str(tmp_path / "harness.lua"), str(tmp_path / "plugin.lua"),
                          str(tmp_path / "lines.txt")], capture_output=True, text=True, check=True).stdout
    return [w == "OK" for w in out.split()]


def test_lua_and_python_agree_on_samples(tmp_path):
    assert _lua_accepts(tmp_path, SAMPLES) == [_python_accepts(s) for s in SAMPLES]
    assert _lua_accepts(tmp_path, SAMPLES[:2]) == [True, True]


_num = st.one_of(st.integers(0, 2_000_000).map(str), st.sampled_from(["01", "00", "1.0", "-1", "", "4x"]))
_weight = st.one_of(st.decimals(min_value=0, max_value=2_000_000, places=7).map(str),
                    st.sampled_from(["1", "0.5", "1.50", "01", "1e3", "nan"]))
_ckpt = st.one_of(st.just(""), st.from_regex(r" ckpt=/[A-Za-z0-9._/+@-]{0,12}", fullmatch=True),
                  st.sampled_from([" ckpt=x", " ckpt=/a b", " ckpt=/../x"]))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(_num, _num, _num, _num, _num, _weight, _ckpt), min_size=30, max_size=30))
def test_lua_and_python_agree_on_generated_specs(tmp_path_factory, rows):
    lines = [f"elastic:v1 gpus={a}-{b} step={c} cpus-per-gpu={d} mem-per-gpu={e}M weight={w}{k}"
             for a, b, c, d, e, w, k in rows]
    valid = [ElasticSpec(lo, hi, step).to_comment() for lo, hi, step in ((1, 4, 1), (2, 8, 2), (8, 64, 8))]
    lines += valid
    tmp = tmp_path_factory.mktemp("lua")
    assert _lua_accepts(tmp, lines) == [_python_accepts(s) for s in lines]
