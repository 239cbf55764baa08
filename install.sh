#!/usr/bin/env bash
# install.sh: one command to a working slurm-elastic install.
#
#   ./install.sh                      # ./.venv with the package, training and simulator extras
#   ./install.sh --dev                # plus test dependencies (editable; as root also Debian's lmod)
#   ./install.sh --with-slurm         # plus Debian's Slurm and munge, for the local cluster
#   ./install.sh --prefix /opt/slurm-elastic   # a site install every user can run, with modulefiles
#   ./install.sh --extras daemon      # choose the extras (default train,sim,daemon,examples;
#                                     # 'daemon' alone: a controller host without torch)
#
# Environment:
#   TORCH_SPEC   what to pip-install when torch is not importable yet (default: torch).
#                On CPU-only machines a CPU build, e.g. TORCH_SPEC=torch==2.13.0+cpu with
#                PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (PyPI's plain one is CUDA).
#   PYTHON       the interpreter for the virtual environment (default: python3, >= 3.11; for
#                --prefix, the system's Python when the default one is private to its owner).
#
# Idempotent: a second run with the same options changes nothing and says so.
# pip's output goes to PREFIX/install.log; the terminal gets one line per step and its duration.
set -euo pipefail
umask 022   # a site install is read by every user, whatever root's umask is

usage() {
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
}

die() { echo "install.sh: $*" >&2; exit 2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix="$here/.venv"
site_install=0
dev=0
with_slurm=0
extras="train,sim,daemon,examples"
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix=$2; site_install=1; shift 2 ;;
        --prefix=*) prefix=${1#--prefix=}; site_install=1; shift ;;
        --extras) [ $# -ge 2 ] || die "--extras needs a list (e.g. train,daemon)"; extras=$2; shift 2 ;;
        --extras=*) extras=${1#--extras=}; shift ;;
        --dev) dev=1; shift ;;
        --with-slurm) with_slurm=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1' (see ./install.sh --help)" ;;
    esac
done
[ -n "$prefix" ] || die "--prefix must not be empty"
case "$prefix" in /*) ;; *) prefix="$PWD/$prefix" ;; esac
[ "$prefix" = "$here/.venv" ] && site_install=0   # the checkout's own venv is the developer's, not a site's
[[ "$extras" =~ ^[a-z,]*$ ]] || die "--extras takes names separated by commas, not '$extras'"
IFS=, read -r -a extra_list <<< "$extras"
for e in "${extra_list[@]}"; do
    case "$e" in train|sim|daemon|examples|pyslurm|fast) ;; *) die "unknown extra '$e' (train, sim, daemon, examples, pyslurm, fast)" ;; esac
done
[ "$dev" = 1 ] && extras="$extras,dev"
[ -n "${extras#,}" ] && extras=${extras#,}
wants() { case ",$extras," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

changed=0
t0=$(date +%s)
say() { echo "install.sh: $*"; }
log=""

# run_step WHAT CMD...: one line when it starts, a line every 30 s while it runs, its duration at the end;
# the command's own output goes to the log, and its tail to stderr only when it fails.
run_step() {
    local what=$1; shift
    local start=$SECONDS
    say "$what ..."
    echo "== $(date -u +%FT%TZ) $what: $*" >>"$log"
    "$@" >>"$log" 2>&1 &
    local pid=$! next=30
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if [ $((SECONDS - start)) -ge $next ]; then
            say "  ... $what: $((SECONDS - start)) s"
            next=$((next + 30))
        fi
    done
    if ! wait "$pid"; then
        tail -n 30 "$log" >&2
        die "$what failed after $((SECONDS - start)) s (full log: $log)"
    fi
    say "  $what: done in $((SECONDS - start)) s"
}

# Can a user other than the interpreter's owner run it? (A pyenv build under /root, mode 0700, cannot.)
public_python() {
    local py
    py=$(command -v "$1" 2>/dev/null) || return 1
    py=$(readlink -f "$py")
    if [ "$(id -u)" = 0 ] && command -v runuser >/dev/null 2>&1; then
        runuser -u nobody -- "$py" -c 'import sys' >/dev/null 2>&1
        return
    fi
    local dir=$py
    [ -r "$py" ] && [ -x "$py" ] || return 1
    while [ "$dir" != / ]; do
        dir=$(dirname "$dir")
        [ "$(stat -c %A "$dir" | cut -c10)" = x ] || [ "$(stat -c %A "$dir" | cut -c10)" = t ] || return 1
    done
}

new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

python=${PYTHON:-python3}
command -v "$python" >/dev/null 2>&1 || die "no '$python' on PATH; set PYTHON=/path/to/python3.11+"
new_enough "$python" || die "$("$python" --version 2>&1) is too old: slurm-elastic needs Python >= 3.11 (set PYTHON=...)"
if [ "$site_install" = 1 ] && [ ! -x "$prefix/bin/python" ] && ! public_python "$python"; then
    [ -z "${PYTHON:-}" ] || die "PYTHON=$PYTHON cannot be run by other users; a site install needs one they can (set PYTHON=...)"
    # The default python3 is private (e.g. pyenv under /root): take the system's, which every user can run.
    found=""
    for candidate in /usr/bin/python3 /usr/bin/python3.14 /usr/bin/python3.13 /usr/bin/python3.12 /usr/bin/python3.11; do
        if [ -x "$candidate" ] && new_enough "$candidate" && public_python "$candidate"; then found=$candidate; break; fi
    done
    [ -n "$found" ] || die "$(readlink -f "$(command -v "$python")") is private to its owner and no system Python >= 3.11 was found; set PYTHON=/path/to/a python3.11+ that every user can run"
    say "$(readlink -f "$(command -v "$python")") is private to its owner: using $found ($("$found" --version 2>&1)) for the site install"
    python=$found
fi

# -- Debian packages: Slurm and munge (the local cluster), lmod (the module tests) ----------------------------
apt_pkgs=""
if [ "$with_slurm" = 1 ]; then
    command -v apt-get >/dev/null 2>&1 || die "--with-slurm needs apt-get (Debian/Ubuntu); install Slurm and munge yourself"
    [ "$(id -u)" = 0 ] || die "--with-slurm installs Debian packages: run it as root"
    apt_pkgs="slurmctld slurmd slurm-client munge"
fi
if [ "$dev" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # The tests load the module in a real Lmod shell (lmod brings lua and tclsh).
    apt_pkgs="$apt_pkgs lmod"
fi
if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
        || die "$python has no venv/ensurepip module: install python3-venv (Debian) or set PYTHON=..."
    pyver=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    apt_pkgs="$apt_pkgs python$pyver-venv"
fi
missing=""
for p in $apt_pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
mkdir -p "$prefix"
log="$prefix/install.log"
if [ -n "$missing" ]; then
    export DEBIAN_FRONTEND=noninteractive
    run_step "apt-get update" apt-get update -qq
    # The local cluster runs private daemons; Debian's own services are not needed.
    run_step "installing Debian packages:$missing" apt-get install -y -qq --no-install-recommends $missing
    changed=1
elif [ "$with_slurm" = 1 ]; then
    say "Slurm and munge already installed (slurmctld $(dpkg-query -W -f='${Version}' slurmctld))"
fi

# -- the virtual environment ------------------------------------------------------------------------------
vpy="$prefix/bin/python"
if [ ! -x "$vpy" ]; then
    run_step "creating virtual environment $prefix ($("$python" --version 2>&1))" "$python" -m venv "$prefix"
    run_step "upgrading pip" "$vpy" -m pip install -q --upgrade pip
    changed=1
fi

# torch: never let a plain requirement pull a multi-GB CUDA build on a CPU machine.
if wants train && ! "$vpy" -c 'import torch' >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-torch}
    run_step "installing $spec (set TORCH_SPEC to choose a build)" "$vpy" -m pip install -q "$spec"
    changed=1
fi

version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$here/slurm_elastic/__init__.py")
[ -n "$version" ] || die "cannot read the version from slurm_elastic/__init__.py"

# The stamp records what was installed: options, pyproject, and (for a copy
# install) the package sources, so an unchanged second run does nothing.
stamp_file="$prefix/.slurm-elastic-install"
if [ "$dev" = 1 ]; then
    sources=$(cat "$here/pyproject.toml")
else
    sources=$(cat "$here/pyproject.toml"; find "$here/slurm_elastic" "$here/job_templates" -type f ! -name '*.pyc' -print0 | sort -z | xargs -0 cat)
fi
stamp=$(printf '%s\n%s\n%s\n%s\n' "$extras" "$dev" "$version" "$sources" | sha256sum | cut -d' ' -f1)
wheel_ok() { [ "$dev" = 1 ] || ls "$prefix"/share/slurm-elastic/wheels/slurm_elastic-"$version"-*.whl >/dev/null 2>&1; }
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && "$prefix/bin/slurm-elastic" --version >/dev/null 2>&1 \
        && wheel_ok; then
    :
else
    if [ "$dev" = 1 ]; then
        run_step "installing slurm-elastic $version [$extras] (editable) into $prefix" "$vpy" -m pip install -q -e "$here[$extras]"
    else
        run_step "installing slurm-elastic $version [$extras] into $prefix" "$vpy" -m pip install -q "$here[$extras]"
        # A researcher's own venv installs the training shim from this wheel ($SLURM_ELASTIC_PACKAGE).
        rm -rf "$prefix/share/slurm-elastic/wheels"
        run_step "building the slurm-elastic $version wheel for users' own environments" \
            "$vpy" -m pip wheel -q --no-deps -w "$prefix/share/slurm-elastic/wheels" "$here"
    fi
    echo "$stamp" > "$stamp_file"
    changed=1
fi

# -- modulefiles (Lmod .lua and Tcl) and the systemd unit -----------------------------------------------------
moddir="$prefix/modulefiles/slurm-elastic"
mkdir -p "$moddir" "$prefix/share/slurm-elastic"
# What `pip install "$SLURM_ELASTIC_PACKAGE[train]"` installs into a user's own environment: the wheel of
# a copy install, the checkout itself for an editable one.
if [ "$dev" = 1 ]; then
    package="$here"
else
    package=$(ls "$prefix"/share/slurm-elastic/wheels/slurm_elastic-"$version"-*.whl 2>/dev/null | head -n 1)
    [ -n "$package" ] || die "the wheel for users' environments is missing in $prefix/share/slurm-elastic/wheels"
fi
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
setenv(\"SLURM_ELASTIC_HOME\", \"$prefix\")
setenv(\"SLURM_ELASTIC_PACKAGE\", \"$package\")"
write_if_changed "$moddir/$version" "#%Module1.0
## slurm-elastic $version (written by install.sh)
module-whatis \"elastic deep-learning training on Slurm\"
proc ModulesHelp { } { puts stderr \"Elastic deep-learning training on Slurm. Try: slurm-elastic --help\" }
prepend-path PATH $prefix/bin
setenv SLURM_ELASTIC_HOME $prefix
setenv SLURM_ELASTIC_PACKAGE $package"
unit=$("$prefix/bin/slurm-elastic" admin unit) || die "cannot write the systemd unit (slurm-elastic admin unit failed)"
write_if_changed "$prefix/share/slurm-elastic/slurm-elastic.service" "$unit"

# -- a site install must run for users other than root -----------------------------------------------------
if [ "$site_install" = 1 ] && [ "$(id -u)" = 0 ] && command -v runuser >/dev/null 2>&1; then
    if ! out=$(cd / && runuser -u nobody -- "$prefix/bin/slurm-elastic" --version 2>&1); then
        die "the install in $prefix does not run as an unprivileged user (nobody): ${out##*$'\n'}"
    fi
fi

if [ "$changed" = 0 ]; then
    say "already up to date in $prefix: nothing changed"
else
    say "done in $(( $(date +%s) - t0 )) s: $prefix/bin/slurm-elastic ($("$prefix/bin/slurm-elastic" --version))"
    say "modules: module use $prefix/modulefiles && module load slurm-elastic"
    say "systemd unit: $prefix/share/slurm-elastic/slurm-elastic.service"
fi
