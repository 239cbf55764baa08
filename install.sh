#!/usr/bin/env bash
# install.sh: one command to a working slurm-elastic install.
#
#   ./install.sh                      # ./.venv with the package, training and simulator extras
#   ./install.sh --dev                # plus test dependencies (editable install)
#   ./install.sh --with-slurm         # plus Debian's Slurm and munge, for the local cluster
#   ./install.sh --prefix /opt/slurm-elastic   # a site install with modulefiles
#
# Environment:
#   TORCH_SPEC   what to pip-install when torch is not importable yet (default: torch).
#                On CPU-only machines use e.g. TORCH_SPEC=torch==2.13.0 (a CPU wheel).
#   PYTHON       the interpreter for the virtual environment (default: python3, >= 3.11).
#
# Idempotent: a second run with the same options changes nothing and says so.
set -euo pipefail

usage() {
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
}

die() { echo "install.sh: $*" >&2; exit 2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix="$here/.venv"
dev=0
with_slurm=0
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix=$2; shift 2 ;;
        --prefix=*) prefix=${1#--prefix=}; shift ;;
        --dev) dev=1; shift ;;
        --with-slurm) with_slurm=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1' (see ./install.sh --help)" ;;
    esac
done
[ -n "$prefix" ] || die "--prefix must not be empty"
case "$prefix" in /*) ;; *) prefix="$PWD/$prefix" ;; esac

python=${PYTHON:-python3}
command -v "$python" >/dev/null 2>&1 || die "no '$python' on PATH; set PYTHON=/path/to/python3.11+"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$("$python" --version 2>&1) is too old: slurm-elastic needs Python >= 3.11 (set PYTHON=...)"

changed=0
say() { echo "install.sh: $*"; }
log=""
pip_quiet() {  # pip's build chatter goes to a log; shown only when pip fails
    if ! "$vpy" -m pip install -q "$@" >>"$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "pip install $* failed (full log: $log)"
    fi
}

# -- Debian's Slurm and munge (the local cluster needs real daemons) --------------------
if [ "$with_slurm" = 1 ]; then
    command -v apt-get >/dev/null 2>&1 || die "--with-slurm needs apt-get (Debian/Ubuntu); install Slurm and munge yourself"
    [ "$(id -u)" = 0 ] || die "--with-slurm installs Debian packages: run it as root"
    pkgs="slurmctld slurmd slurm-client munge"
    missing=""
    for p in $pkgs; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
    done
    if [ -n "$missing" ]; then
        say "installing Debian packages:$missing"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        # The local cluster runs private daemons; Debian's own services are not needed.
        apt-get install -y -qq --no-install-recommends $missing >/dev/null
        changed=1
    else
        say "Slurm and munge already installed (slurmctld $(dpkg-query -W -f='${Version}' slurmctld))"
    fi
fi

# -- the virtual environment ------------------------------------------------------------
vpy="$prefix/bin/python"
log="$prefix/install.log"
if [ ! -x "$vpy" ]; then
    say "creating virtual environment $prefix"
    mkdir -p "$(dirname "$prefix")"
    "$python" -m venv "$prefix"
    pip_quiet --upgrade pip
    changed=1
fi

# torch: never let a plain requirement pull a multi-GB CUDA build on a CPU machine.
if ! "$vpy" -c 'import torch' >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-torch}
    say "installing $spec (set TORCH_SPEC to choose a build)"
    pip_quiet "$spec"
    changed=1
fi

extras="train,sim,daemon,examples"
[ "$dev" = 1 ] && extras="$extras,dev"
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$here/slurm_elastic/__init__.py")
[ -n "$version" ] || die "cannot read the version from slurm_elastic/__init__.py"

# The stamp records what was installed: options, pyproject, and (for a copy
# install) the package sources, so an unchanged second run does nothing.
stamp_file="$prefix/.slurm-elastic-install"
if [ "$dev" = 1 ]; then
    sources=$(cat "$here/pyproject.toml")
else
    sources=$(cat "$here/pyproject.toml"; find "$here/slurm_elastic" -type f ! -name '*.pyc' -print0 | sort -z | xargs -0 cat)
fi
stamp=$(printf '%s\n%s\n%s\n%s\n' "$extras" "$dev" "$version" "$sources" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && "$prefix/bin/slurm-elastic" --version >/dev/null 2>&1; then
    :
else
    say "installing slurm-elastic $version [$extras] into $prefix"
    if [ "$dev" = 1 ]; then
        pip_quiet -e "$here[$extras]"
    else
        pip_quiet "$here[$extras]"
    fi
    echo "$stamp" > "$stamp_file"
    changed=1
fi

# -- modulefiles (Lmod .lua and Tcl) ------------------------------------------------------
moddir="$prefix/modulefiles/slurm-elastic"
mkdir -p "$moddir"
write_if_changed() {  # file content
    if [ ! -f "$1" ] || [ "$(cat "$1")" != "$2" ]; then
        printf '%s\n' "$2" > "$1"
        changed=1
    fi
}
write_if_changed "$moddir/$version.lua" "-- slurm-elastic $version (written by install.sh)
whatis(\"Name: slurm-elastic\")
whatis(\"Version: $version\")
whatis(\"Description: elastic deep-learning training on Slurm\")
help([[Elastic deep-learning training on Slurm. Try: slurm-elastic --help]])
prepend_path(\"PATH\", \"$prefix/bin\")
setenv(\"SLURM_ELASTIC_HOME\", \"$prefix\")"
write_if_changed "$moddir/$version" "#%Module1.0
## slurm-elastic $version (written by install.sh)
module-whatis \"elastic deep-learning training on Slurm\"
proc ModulesHelp { } { puts stderr \"Elastic deep-learning training on Slurm. Try: slurm-elastic --help\" }
prepend-path PATH $prefix/bin
setenv SLURM_ELASTIC_HOME $prefix"

if [ "$changed" = 0 ]; then
    say "already up to date in $prefix: nothing changed"
else
    say "done: $prefix/bin/slurm-elastic ($("$prefix/bin/slurm-elastic" --version))"
    say "modules: module use $prefix/modulefiles && module load slurm-elastic"
fi
