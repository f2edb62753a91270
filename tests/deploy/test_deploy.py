"""deploy/ checked by the tools operators use: systemd-analyze verify on the unit, hadolint
on the Containerfile, kubernetes-validate on the manifests, promtool on the alert rules,
the TypeScript compiler with Grafana's foundation SDK types on the dashboard; and every
metric a panel or an alert reads is exported by a live supervisor's and engine's /metrics.

Debian and npm tools come from scripts/deploy-tools.sh (installed when missing), the PyPI
ones from the `dev` extra.
"""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "holdfast-supervisor.service"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DASHBOARD = DEPLOY / "grafana" / "holdfast-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "holdfast-alerts.yaml"
METRIC = re.compile(r"\bholdfast_[a-z0-9_]+")


def run(*argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False
    )


def tool(name: str) -> str:
    """A console script of this Python's environment (the `dev` extra), or on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: install the dev extra (pip install -e '.[dev]')")
    return found


@pytest.fixture(scope="module")
def tools() -> Path:
    """scripts/deploy-tools.sh: promtool, node and the npm packages; their dir."""
    cp = run("bash", REPO / "scripts" / "deploy-tools.sh", timeout=900)
    if cp.returncode != 0:
        pytest.fail(f"scripts/deploy-tools.sh failed ({cp.returncode}):\n{cp.stderr[-3000:]}")
    return Path(cp.stdout.strip().splitlines()[-1])


# ---- systemd ----


def unit_here(tmp_path: Path, text: str | None = None) -> Path:
    """The unit as installed on this machine: ExecStart names this machine's `supervisor`
    (the unit's /opt/holdfast/venv does not exist here), nothing else changed."""
    text = UNIT.read_text() if text is None else text
    here = tmp_path / UNIT.name
    here.write_text(text.replace("/opt/holdfast/venv/bin/supervisor", tool("supervisor")))
    return here


def verify(unit: Path) -> list[str]:
    """systemd-analyze verify's complaints about `unit` (none from other units it loads)."""
    cp = run("systemd-analyze", "verify", unit)
    lines = [ln for ln in cp.stderr.splitlines() if unit.name in ln]
    if cp.returncode != 0:
        lines.append(f"exit {cp.returncode}: {cp.stderr.strip()}")
    return lines


def test_the_unit_verifies_clean(tmp_path: Path) -> None:
    assert verify(unit_here(tmp_path)) == []


def test_verify_catches_a_bad_setting(tmp_path: Path) -> None:
    """systemd-analyze only warns on a bad value (exit 0): the warning must fail the check."""
    bad = unit_here(tmp_path, UNIT.read_text().replace("KillMode=mixed", "KillMode=mixd"))
    assert any("kill mode" in line for line in verify(bad))


def test_the_unit_runs_as_documented() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(UNIT.read_text())
    s = unit["Service"]
    assert s["Type"] == "notify" and s["KillMode"] == "mixed"
    assert "ExecReload" not in s  # the supervisor does not re-read its policy on SIGHUP
    assert s["User"] == "holdfast" and s["RuntimeDirectory"] == "holdfast"
    assert s["RuntimeDirectoryMode"] == "0700"
    assert s["LimitMEMLOCK"] == "infinity" and int(s["LimitNOFILE"]) >= 65536
    policy = yaml.safe_load((DEPLOY / "systemd" / "policy.yaml").read_text())
    assert policy["cache"]["runtime_dir"] == "/run/" + s["RuntimeDirectory"]
    assert s["ExecStart"].endswith("run /etc/holdfast/policy.yaml")


def test_sysusers_creates_the_units_user(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    conf = DEPLOY / "systemd" / "holdfast.sysusers.conf"
    cp = run("systemd-sysusers", f"--root={tmp_path}", conf)
    assert cp.returncode == 0, cp.stderr
    user = [ln.split(":") for ln in (tmp_path / "etc" / "passwd").read_text().splitlines()]
    (entry,) = [u for u in user if u[0] == "holdfast"]
    assert entry[5] == "/var/lib/holdfast" and entry[6] == "/usr/sbin/nologin"
    assert "holdfast:" in (tmp_path / "etc" / "group").read_text()


def test_no_sighup_handler_in_the_supervisor() -> None:
    """What the unit and docs/deploy.md say: `systemctl reload` is not supported. If the
    supervisor learns SIGHUP, give the unit an ExecReload and say so in the docs."""
    code = "\n".join(p.read_text() for p in (REPO / "supervisor").rglob("*.py"))
    assert "SIGHUP" not in code


@pytest.mark.parametrize(
    "policy", ["systemd/policy.yaml", "container/policy.yaml"], ids=["systemd", "container"]
)
def test_shipped_policies_validate(policy: str) -> None:
    cp = run(sys.executable, "-m", "supervisor", "validate", "--schema-only", DEPLOY / policy)
    assert cp.returncode == 0, cp.stdout + cp.stderr


# ---- container ----


def test_containerfile_lints_clean() -> None:
    cp = run(tool("hadolint"), "--failure-threshold", "info", "--no-color", CONTAINERFILE)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_hadolint_catches_a_root_image(tmp_path: Path) -> None:
    bad = tmp_path / "Containerfile"
    bad.write_text(CONTAINERFILE.read_text().replace("USER 10001:10001", "USER root"))
    cp = run(tool("hadolint"), "--no-color", bad)
    assert cp.returncode != 0 and "DL3002" in cp.stdout, cp.stdout


def test_containerfile_copies_tracked_files_runs_unprivileged_and_checks_health() -> None:
    text = CONTAINERFILE.read_text()
    tracked = set(run("git", "-C", REPO, "ls-files").stdout.splitlines())
    for line in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for src in line.split():
            assert src in tracked or any(t.startswith(src + "/") for t in tracked), src
    assert re.findall(r"^USER (.+)$", text, re.M)[-1] == "10001:10001"
    policy = yaml.safe_load((DEPLOY / "container" / "policy.yaml").read_text())
    port = policy["api"]["listen"].rsplit(":", 1)[1]
    assert f"http://127.0.0.1:{port}/health" in text.split("HEALTHCHECK", 1)[1]


# ---- kubernetes ----


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m.name for m in MANIFESTS])
def test_manifest_validates_against_kubernetes_schemas(manifest: Path, version: str) -> None:
    argv = ["-m", "kubernetes_validate", "--strict", "-k", version, manifest]
    cp = run(sys.executable, *argv)
    assert cp.returncode == 0 and "passed" in cp.stdout, cp.stdout + cp.stderr


def test_the_validator_refuses_an_unknown_field(tmp_path: Path) -> None:
    bad = tmp_path / "statefulset.yaml"
    text = (DEPLOY / "kubernetes" / "statefulset.yaml").read_text()
    bad.write_text(text.replace("readinessProbe:", "readinesProbe:"))
    cp = run(sys.executable, "-m", "kubernetes_validate", "--strict", bad)
    assert cp.returncode != 0 and "readinesProbe" in cp.stdout + cp.stderr


def test_the_pods_start_renders_a_valid_policy_and_its_probes_agree(tmp_path: Path) -> None:
    """The container's start command itself, run by sh with the pod's environment: the
    ConfigMap's template at /etc/holdfast, the rendered policy in /var/lib/holdfast (both
    moved under tmp_path), and `supervisor validate` in place of `supervisor run`."""
    (sts,) = yaml.safe_load_all((DEPLOY / "kubernetes" / "statefulset.yaml").read_text())
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    (config,) = yaml.safe_load_all((DEPLOY / "kubernetes" / "configmap.yaml").read_text())
    for d in ("etc", "state"):
        (tmp_path / d).mkdir()
    (tmp_path / "etc" / "policy.yaml.in").write_text(config["data"]["policy.yaml.in"])
    assert c["command"][:2] == ["tini", "--"]
    (script,) = c["args"]
    script = script.replace("/etc/holdfast/", f"{tmp_path}/etc/").replace(
        "/var/lib/holdfast/", f"{tmp_path}/state/"
    )
    script = script.replace("exec supervisor run", "exec supervisor validate --schema-only")
    assert "supervisor validate" in script
    env = {"PATH": f"{Path(tool('supervisor')).parent}:/usr/bin:/bin"}
    env |= {"POD_NAME": "holdfast-0", "POD_IP": "10.1.2.3"}
    cp = subprocess.run(
        [*c["command"][2:], script], env=env, capture_output=True, text=True, timeout=120
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    policy = yaml.safe_load((tmp_path / "state" / "policy.yaml").read_text())
    assert policy["cluster"]["node"] == "holdfast-0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["api"] == int(policy["api"]["listen"].rsplit(":", 1)[1])
    assert ports["router"] == int(policy["router"]["listen"].rsplit(":", 1)[1])
    assert c["readinessProbe"]["httpGet"]["path"] == "/primary"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert policy["cluster"]["etcd"] and policy["cluster"]["advertise"] == "10.1.2.3:8000"


# ---- grafana and prometheus ----


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out += [p, *p.get("panels", [])]
    return [p for p in out if p["type"] != "row"]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in panels(dash) for t in p["targets"]]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


TYPES = r"""
import type * as dashboard from "@grafana/grafana-foundation-sdk/dist/dashboard";
import type * as prometheus from "@grafana/grafana-foundation-sdk/dist/prometheus";

// The SDK's types as JSON carries them: string enums as their values, no methods.
type Json<T> = 0 extends 1 & T
  ? any
  : T extends (...args: any[]) => any
    ? never
    : T extends string
      ? `${T}`
      : T extends number | boolean | null | undefined
        ? T
        : T extends (infer U)[]
          ? Json<U>[]
          : { [K in keyof T as T[K] extends (...args: any[]) => any ? never : K]: Json<T[K]> };
type Target = Json<prometheus.dataquery>;
type Panel = Omit<Json<dashboard.Panel>, "targets"> & { targets?: Target[] };
type Row = Omit<Json<dashboard.RowPanel>, "panels"> & { panels: Panel[] };
type Dashboard = Omit<Json<dashboard.Dashboard>, "panels"> & { panels?: (Panel | Row)[] };

export const dash: Dashboard =
"""


def typecheck(tools: Path, tmp_path: Path, dashboard: str) -> subprocess.CompletedProcess[str]:
    """tsc on the dashboard as an object literal of the SDK's Dashboard type: unknown
    fields and wrong types are errors."""
    work = tmp_path / "tsc"
    work.mkdir()
    (work / "node_modules").symlink_to(tools / "node_modules")
    (work / "check.ts").write_text(TYPES + dashboard + ";\n")
    tsc = tools / "node_modules" / "typescript" / "bin" / "tsc"
    flags = ["--noEmit", "--strict", "--target", "es2020", "--moduleResolution", "node"]
    return run("node", tsc, *flags, work / "check.ts")


def test_dashboard_has_grafanas_schema(tools: Path, tmp_path: Path) -> None:
    cp = typecheck(tools, tmp_path, DASHBOARD.read_text())
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_the_schema_check_refuses_a_misspelt_field(tools: Path, tmp_path: Path) -> None:
    cp = typecheck(tools, tmp_path, DASHBOARD.read_text().replace('"expr"', '"exp"', 1))
    assert cp.returncode != 0 and "'\"exp\"' does not exist" in cp.stdout, cp.stdout


def test_alert_rules_pass_promtool(tools: Path) -> None:
    cp = run("promtool", "check", "rules", ALERTS)
    assert cp.returncode == 0 and "SUCCESS: 7 rules found" in cp.stdout, cp.stdout + cp.stderr


def test_dashboard_queries_parse_as_promql(tools: Path, tmp_path: Path) -> None:
    """Each panel query as a recording rule: promtool parses every expression."""
    exprs = dashboard_exprs()
    rules = [{"record": f"holdfast:panel_query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    cp = run("promtool", "check", "rules", path)
    assert cp.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in cp.stdout, cp.stdout
