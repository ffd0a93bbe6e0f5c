"""Reads docker-compose.yml where `docker compose config` cannot run (no
Docker engine or compose plugin here) and checks the production shape that
the README promises. Exits non-zero naming what is wrong."""
import sys

import yaml

with open(sys.argv[1] if len(sys.argv) > 1 else "docker-compose.yml") as f:
    doc = yaml.safe_load(f)

problems = []
services = doc.get("services", {})
for name in ("postgres", "kafka", "registry"):
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

if problems:
    print("\n".join(problems))
    sys.exit(1)
print(f"docker-compose.yml: {len(services)} services, shape ok")
