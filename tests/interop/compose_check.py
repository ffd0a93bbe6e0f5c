"""Reads docker-compose.yml where `docker compose config` cannot run (no
Docker engine or compose plugin here) and checks the production shape that
the README promises, with the monitoring beside it: the Prometheus scrape
config and alert rules and the Grafana dashboard under deploy/, whose
metric names must be the ones src/observe/mod.rs defines. Exits non-zero
naming what is wrong."""
import json
import os
import posixpath
import re
import sys

import yaml

COMPOSE = sys.argv[1] if len(sys.argv) > 1 else "docker-compose.yml"
ROOT = os.path.dirname(os.path.abspath(COMPOSE))
with open(COMPOSE) as f:
    doc = yaml.safe_load(f)

problems = []
services = doc.get("services", {})
for name in ("postgres", "kafka", "registry", "pgcdc-connector", "pgcdc-materializer",
             "prometheus", "grafana"):
    if name not in services:
        problems.append(f"services.{name} is missing")

pg = services.get("postgres", {})
image = str(pg.get("image", ""))
version = image.split(":")[-1].split("-")[0] if ":" in image else ""
if not version.isdigit() or int(version) < 16:
    problems.append(f"services.postgres.image must be Postgres 16 or newer, is '{image}'")
if "wal_level=logical" not in " ".join(map(str, pg.get("command", []))):
    problems.append("services.postgres.command must set wal_level=logical")

kafka_env = services.get("kafka", {}).get("environment", {})
if "controller" not in str(kafka_env.get("KAFKA_PROCESS_ROLES", "")):
    problems.append("services.kafka must run in KRaft mode (KAFKA_PROCESS_ROLES with controller)")

for name, svc in services.items():
    for dep in (svc.get("depends_on") or {}):
        if dep not in services:
            problems.append(f"services.{name}.depends_on names unknown service '{dep}'")

def mounts(svc):
    """(host, container) of each bind mount given as a ./ path."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            host, target = str(v.get("source", "")), str(v.get("target", ""))
        else:
            parts = str(v).split(":")
            host, target = parts[0], (parts[1] if len(parts) > 1 else "")
        if host.startswith("./"):
            out.append((host, target))
    return out


for name, svc in services.items():
    for host, _ in mounts(svc):
        if not os.path.exists(os.path.join(ROOT, host)):
            problems.append(f"services.{name}.volumes mounts '{host}', which does not exist")


def command(svc):
    cmd = svc.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


http_ports = {}
for name, sub in (("pgcdc-connector", "run"), ("pgcdc-materializer", "materialize")):
    cmd = command(services.get(name, {}))
    if not cmd or cmd[0] != sub:
        problems.append(f"services.{name}.command must start with '{sub}'")
    if "--http-addr" not in cmd or cmd.index("--http-addr") + 1 >= len(cmd):
        problems.append(f"services.{name}.command must carry --http-addr ADDR")
    else:
        http_ports[name] = cmd[cmd.index("--http-addr") + 1].rsplit(":", 1)[-1]


def load(rel, parse):
    path = os.path.join(ROOT, rel)
    try:
        with open(path) as f:
            return parse(f)
    except (OSError, ValueError, yaml.YAMLError) as e:
        problems.append(f"{rel} does not parse: {e}")
        return None


# The metric names src/observe/mod.rs defines; a histogram is exported as
# a summary, so its _sum and _count series exist too.
source = load("src/observe/mod.rs", lambda f: f.read()) or ""
consts = dict(re.findall(r'pub const ([A-Z0-9_]+): &str = "([^"]+)";', source))
metric_names = set(consts.values())
for const in re.findall(r"describe_histogram!\(\s*([A-Z0-9_]+)", source):
    if const in consts:
        metric_names |= {consts[const] + "_sum", consts[const] + "_count"}
if not metric_names:
    problems.append("src/observe/mod.rs defines no metric names (pub const X: &str)")


def check_names(where, expr):
    for m in re.findall(r"pgcdc_[a-z_]+", expr):
        if m not in metric_names:
            problems.append(f"{where}: expr '{expr}' uses '{m}', not a metric src/observe/mod.rs defines")


rules = load("deploy/prometheus/alerts.yml", yaml.safe_load) or {}
exprs = [
    (r.get("alert") or r.get("record"), str(r.get("expr", "")))
    for g in rules.get("groups") or []
    for r in g.get("rules") or []
]
for name, expr in exprs:
    check_names(f"deploy/prometheus/alerts.yml rule {name}", expr)
for alert in ("slot_stalled", "slot_wal_at_risk", "rebuild_reach_short",
              "dlq_arrival_burst", "dlq_oldest_overdue"):
    if not any(f'alert="{alert}"' in expr for _, expr in exprs):
        problems.append(f"deploy/prometheus/alerts.yml has no rule on pgcdc_alert{{alert=\"{alert}\"}}")

prom = load("deploy/prometheus/prometheus.yml", yaml.safe_load) or {}
prom_mounts = mounts(services.get("prometheus", {}))
mounted_at = {target for _, target in prom_mounts}
config_at = next((t for h, t in prom_mounts if h.endswith("/prometheus.yml")), None)
if config_at is None:
    problems.append("services.prometheus does not mount deploy/prometheus/prometheus.yml")
else:
    for rf in prom.get("rule_files") or []:
        if posixpath.join(posixpath.dirname(config_at), rf) not in mounted_at:
            problems.append(f"prometheus.yml rule_files '{rf}' is not mounted beside the config")
for job in prom.get("scrape_configs") or []:
    targets = [t for sc in job.get("static_configs") or [] for t in sc.get("targets") or []]
    if not targets:
        problems.append(f"prometheus.yml job '{job.get('job_name')}' has no targets")
    for t in targets:
        host, _, port = str(t).rpartition(":")
        if host not in services:
            problems.append(f"prometheus.yml job '{job.get('job_name')}' targets '{t}', not a compose service")
        elif host in http_ports and port != http_ports[host]:
            problems.append(f"prometheus.yml job '{job.get('job_name')}' targets port {port}, "
                            f"but {host} serves --http-addr on {http_ports[host]}")

dash = load("deploy/grafana/dashboards/pgcdc.json", json.load) or {}


def walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


datasources = load("deploy/grafana/provisioning/datasources/prometheus.yml", yaml.safe_load) or {}
ds_uids = {d.get("uid") for d in datasources.get("datasources") or []}
dash_exprs = 0
for node in walk(dash.get("panels") or []):
    if "expr" in node:
        dash_exprs += 1
        check_names(f"deploy/grafana/dashboards/pgcdc.json panel target {node.get('refId')}", str(node["expr"]))
    ds = node.get("datasource")
    if isinstance(ds, dict) and ds.get("type") == "prometheus" and ds.get("uid") not in ds_uids:
        problems.append(f"deploy/grafana/dashboards/pgcdc.json names datasource uid '{ds.get('uid')}', "
                        f"not one provisioned ({sorted(u for u in ds_uids if u)})")
if dash and not dash_exprs:
    problems.append("deploy/grafana/dashboards/pgcdc.json has no panel queries")

providers = load("deploy/grafana/provisioning/dashboards/pgcdc.yml", yaml.safe_load) or {}
grafana_targets = {t for _, t in mounts(services.get("grafana", {}))}
for prov in providers.get("providers") or []:
    path = (prov.get("options") or {}).get("path")
    if path not in grafana_targets:
        problems.append(f"grafana dashboard provider path '{path}' is not a mount of services.grafana")

if problems:
    print("\n".join(problems))
    sys.exit(1)
print(f"docker-compose.yml: {len(services)} services, shape ok; "
      f"{len(exprs)} alert rules and {dash_exprs} dashboard queries on known metrics")
