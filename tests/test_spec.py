"""ElasticSpec: the canonical comment form and the parsing of flags and #ELASTIC lines."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from slurm_elastic.errors import SpecError
from slurm_elastic.spec import ElasticSpec, parse_directives, parse_memory_mb, spec_from_options


@st.composite
def specs(draw: st.DrawFn) -> ElasticSpec:
    step = draw(st.integers(1, 8))
    lo = step * draw(st.integers(1, 16))
    hi = lo + step * draw(st.integers(0, 16))
    weight = draw(st.integers(1, 10_000_000)) / 1000
    ckpt = draw(st.one_of(st.none(), st.from_regex(r"/[a-z0-9_.-]{1,12}(/[a-z0-9_-]{1,8}){0,3}", fullmatch=True)))
    return ElasticSpec(lo, hi, step, draw(st.integers(1, 64)), draw(st.integers(1, 10**6)), weight, ckpt)


@given(specs())
def test_canonical_round_trip(spec: ElasticSpec) -> None:
    text = spec.to_comment()
    assert ElasticSpec.from_comment(text) == spec
    assert ElasticSpec.is_elastic_comment(text)


def test_canonical_text_is_stable() -> None:
    spec = ElasticSpec(2, 8, 2, 4, 4000, 1.5, "/scratch/ckpt")
    assert spec.to_comment() == ("elastic:v1 gpus=2-8 step=2 cpus-per-gpu=4 mem-per-gpu=4000M "
                                 "weight=1.5 ckpt=/scratch/ckpt")


@pytest.mark.parametrize("text", [
    "",
    "elastic:v1",
    "elastic:v1 gpus=8-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",          # min > max
    "elastic:v1 gpus=0-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",          # zero
    "elastic:v1 gpus=-1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",         # negative
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=0",          # zero weight
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=nan",        # NaN
    "elastic:v1 gpus=a-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",          # not a number
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 user=bob",  # unknown key
    "elastic:v1 step=1 gpus=1-2 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",          # order
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1.0",        # not canonical
    "elastic:v1 gpus=01-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",         # leading zero
    "elastic:v1  gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",         # double space
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 ckpt=rel",  # relative
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 ckpt=/a/../etc",
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 ckpt=/a;rm -rf /",
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 ckpt=/a$(id)",
    "elastic:v1 gpus=3-8 step=2 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",          # not step multiples
    "elastic:v1 gpus=1-999999 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",     # huge
    "elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1\n",        # trailing newline
])
def test_malformed_comments_are_refused(text: str) -> None:
    with pytest.raises(SpecError):
        ElasticSpec.from_comment(text)


def test_flags_build_a_spec() -> None:
    spec = spec_from_options({"gpus": "4-32", "gpu_step": "4", "mem_per_gpu": "8G", "weight": "2"})
    assert (spec.min_gpus, spec.max_gpus, spec.gpu_step, spec.mem_per_gpu_mb, spec.weight) == (4, 32, 4, 8192, 2.0)
    assert list(spec.allowed_gpus()) == [4, 8, 12, 16, 20, 24, 28, 32]
    assert spec_from_options({"gpus": "8"}).min_gpus == 8


@pytest.mark.parametrize("options, message", [
    ({}, "needs --gpus"),
    ({"gpus": "8-4"}, "exceeds max"),
    ({"gpus": "x"}, "MIN-MAX"),
    ({"gpus": "2-8", "gpu_step": "-1"}, "positive whole number"),
    ({"gpus": "2-8", "mem_per_gpu": "lots"}, "K/M/G/T"),
    ({"gpus": "2-8", "weight": "inf"}, "positive finite"),
    ({"gpus": "2-8", "color": "red"}, "unknown elastic option"),
])
def test_bad_flags_have_clear_messages(options: dict[str, str], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        spec_from_options(options)


def test_memory_units() -> None:
    assert parse_memory_mb("4000") == 4000
    assert parse_memory_mb("4G") == 4096
    assert parse_memory_mb("1T") == 1024 * 1024
    assert parse_memory_mb("2048K") == 2
    with pytest.raises(SpecError, match="at least 1M"):
        parse_memory_mb("512K")


def test_directives_stop_at_first_command_like_sbatch() -> None:
    script = "#!/bin/bash\n#SBATCH -t 10\n#ELASTIC --gpus 2-8 --gpu-step=2\n\n#ELASTIC --weight 3\necho hi\n#ELASTIC --gpus 1-1\n"
    assert parse_directives(script) == {"gpus": "2-8", "gpu_step": "2", "weight": "3"}


@pytest.mark.parametrize("script, message", [
    ("#!/bin/sh\n#ELASTIC --colour red\n", "unknown #ELASTIC option"),
    ("#!/bin/sh\n#ELASTIC --gpus\n", "needs a value"),
    ("#!/bin/sh\n#ELASTICX --gpus 2\n", "expected '#ELASTIC"),
])
def test_bad_directives(script: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_directives(script)
