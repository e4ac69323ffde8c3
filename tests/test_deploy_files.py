"""bootstrap/: the deployment files are checked against the code they deploy.

* every ``ExecStart=`` of the systemd units (drop-ins included) and the Containerfile's
  ENTRYPOINT + CMD parse with the real CLI parser, with the placeholders of bootstrap/p2pswarm.env
  substituted; the relay's command lines also load their config file the way `p2pswarm relay` does;
* the units carry the hardening keys, a capability only where a port below 1024 is bound, and
  `systemd-analyze verify` (where installed) has nothing to say about them;
* bootstrap/relay.toml names every setting p2pswarm/relay/config.py knows, loads, and holds the defaults
  except for the values it states; unedited, the relay refuses it (placeholder issuer);
* the Containerfile's paths, ports and HEALTHCHECK agree with relay.toml;
* the `p2pswarm ...` commands in docs/deploy.md parse;
* slow: a real `p2pswarm relay --config bootstrap/relay.toml` (listen/health on free loopback ports)
  prints READY, serves GET /health (and passes the Containerfile's HEALTHCHECK), answers a WebSocket
  upgrade, stops on SIGTERM; and the direct-443 drop-in's command line, with a self-signed
  certificate, serves /wss to a relayed worker that dials it by name (/dns4/localhost/.../wss).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli
from helpers.procs import Proc, free_port
from helpers.tls import make_cert

from p2pswarm.relay.config import RelaySettings, load_settings
from helpers.deploy_files import (ROOT, SYSTEMD, RELAY_TOML, INSTANCE_ENV, CONTAINERFILE, DEPLOY_MD,
                                  VENV_BIN, STATE_DIR, STATED, UNITS, REQUIRED_UNITS, read_unit, unit_values,
                                  unit_value, effective, variants, read_env_file, env_samples, substitute,
                                  parse_cli, relay_settings, exec_start, listen_ports)


# -- systemd units -----------------------------------------------------------------------------------
def test_the_units_are_there():
    assert REQUIRED_UNITS <= {u.name for u in UNITS}
    assert (SYSTEMD / "p2pswarm-relay.service.d" / "direct-443.conf").is_file()


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_exec_start_parses_with_the_real_cli(unit):
    for name, entries in variants(unit):
        args = parse_cli(exec_start(name, entries))
        command = {"p2pswarm-relay.service": "relay", "p2pswarm-relay@.service": "relay",
                   "p2pswarm-bootstrap.service": "bootstrap",
                   "p2pswarm-backbone.service": "node", "p2pswarm-shards.service": "serve_shards"}[unit.name]
        assert args.command.replace("-", "_") == command, name
        if command == "relay":
            s = relay_settings(args)  # raises UserError on a bad combination (e.g. /wss without a cert)
            assert s.identity and s.identity.startswith(STATE_DIR + "/"), s.identity
            if any("/wss" in a for a in s.listen):
                assert s.tls_cert and s.tls_key
                assert s.tls_cert.startswith("/run/credentials/") and s.tls_key.startswith("/run/credentials/"), \
                    "the certificate comes in through LoadCredential="
                creds = {v.split(":", 1)[0] for v in unit_values(entries, "LoadCredential")}
                assert {Path(s.tls_cert).name, Path(s.tls_key).name} <= creds, (creds, s.tls_cert, s.tls_key)
        else:
            assert args.identity and args.identity.startswith(STATE_DIR + "/identity/"), (name, args.identity)
        if command == "node":
            assert args.role == "backbone"
        if command in ("node", "serve_shards"):
            # Neither honours an announce address: they advertise (and print in READY) their listen
            # addresses, and with 0.0.0.0 they have none (IndexError at start).
            assert not re.search(r"/ip4/0\.0\.0\.0/|/ip6/::/", " ".join(args.listen)), (name, args.listen)


def test_units_do_not_share_an_identity():
    """Two services with one key would be one peer id twice in the DHT."""
    seen: dict[str, str] = {}
    for unit in UNITS:
        args = parse_cli(exec_start(unit.name, read_unit(unit)))
        ident = relay_settings(args).identity if args.command == "relay" else args.identity
        assert ident not in seen, f"{unit.name} and {seen.get(ident)} both use {ident}"
        seen[ident] = unit.name


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_hardening(unit):
    for name, entries in variants(unit):
        def v(key: str, entries=entries) -> str | None:
            return unit_value(entries, key)

        assert v("User") == "p2pswarm" and v("Group") == "p2pswarm", name
        assert v("StateDirectory") == "p2pswarm" and v("StateDirectoryMode") == "0700", name
        assert f"P2PSWARM_HOME={STATE_DIR}" in " ".join(unit_values(entries, "Environment")), name
        assert unit_values(entries, "EnvironmentFile") == (
            ["/etc/p2pswarm/p2pswarm.env", "/etc/p2pswarm/relay-%i.env"] if "@" in unit.name
            else ["/etc/p2pswarm/p2pswarm.env"]), name
        assert v("Restart") == "on-failure", name
        assert v("NoNewPrivileges") == "yes", name
        assert v("ProtectSystem") == "strict", name
        assert v("ProtectHome") == "yes" and v("PrivateTmp") == "yes" and v("PrivateDevices") == "yes", name
        assert v("UMask") == "0077", name
        assert v("KillSignal") in (None, "SIGTERM"), name
        assert int(v("LimitNOFILE")) >= 4096, name
        # A capability only where a port below 1024 is bound, and then only CAP_NET_BIND_SERVICE.
        args = parse_cli(exec_start(name, entries))
        privileged = any(p < 1024 for p in listen_ports(args))
        ambient = " ".join(unit_values(entries, "AmbientCapabilities")).split()
        bounding = " ".join(unit_values(entries, "CapabilityBoundingSet")).split()
        if privileged:
            assert ambient == ["CAP_NET_BIND_SERVICE"] and bounding == ["CAP_NET_BIND_SERVICE"], (name, ambient)
        else:
            assert ambient == [] and bounding == [], f"{name}: binds no port < 1024 but keeps {ambient or bounding}"
        assert unit_value(entries, "WantedBy", "Install") == "multi-user.target", name


def test_relay_unit_has_file_descriptors_for_every_reservation():
    entries = read_unit(SYSTEMD / "p2pswarm-relay.service")
    s = relay_settings(parse_cli(exec_start("relay", entries)))
    assert int(unit_value(entries, "LimitNOFILE")) > s.max_reservations + s.max_circuits_per_peer


def test_direct_443_drop_in_binds_443_with_tls():
    entries = effective(SYSTEMD / "p2pswarm-relay.service")
    s = relay_settings(parse_cli(exec_start("relay+direct", entries)))
    assert s.listen == ["/ip4/0.0.0.0/tcp/443/wss"]
    assert s.announce == STATED["announce"]


@pytest.mark.slow
def test_systemd_analyze_verify_has_nothing_to_say(tmp_path):
    """Unknown keys, bad values, misplaced sections: systemd's own parser. The ExecStart binary is
    pointed at this checkout's `p2pswarm` (verify insists that it exists)."""
    from system_tools import require

    require("systemd-analyze")
    binary = shutil.which("p2pswarm") or sys.executable
    for path in SYSTEMD.rglob("*"):
        if path.is_file() and path.suffix in (".service", ".conf") and path.name != "p2pswarm.sysusers.conf":
            dest = tmp_path / path.relative_to(SYSTEMD)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(path.read_text().replace(VENV_BIN, binary))
    names = [u.name for u in UNITS]
    proc = subprocess.run(["systemd-analyze", "verify", *names], check=False, cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"}, timeout=60)
    ours = [ln for ln in (proc.stdout + proc.stderr).splitlines() if str(tmp_path) in ln or "p2pswarm" in ln]
    assert proc.returncode == 0 and not ours, proc.stdout + proc.stderr


def test_sysusers_file_declares_the_unit_user():
    lines = [ln.split() for ln in (SYSTEMD / "p2pswarm.sysusers.conf").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert any(p[:2] == ["u", "p2pswarm"] and STATE_DIR in p for p in lines), lines


def test_env_file_sets_only_what_the_units_use():
    used = set()
    for unit in UNITS:
        for name, entries in variants(unit):
            used |= set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", " ".join(unit_values(entries, "ExecStart"))))
    unused = set(env_samples()) - used - {"CREDENTIALS_DIRECTORY", "P2PSWARM_LOG_LEVEL"}
    assert not unused, f"bootstrap/p2pswarm.env sets {sorted(unused)}, which no unit uses"
    unused = set(read_env_file(INSTANCE_ENV)) - used
    assert not unused, f"bootstrap/relay-instance.env sets {sorted(unused)}, which no unit uses"


def test_relay_instances_are_other_relays_that_join_the_first():
    """p2pswarm-relay@N: relay.toml's settings, but its own key, ports and public name, and the first
    relay as DHT bootstrap (relays share nothing but the DHT: p2pswarm/net/libp2p/relay_discovery.py)."""
    first = relay_settings(parse_cli(exec_start("p2pswarm-relay.service", read_unit(SYSTEMD / "p2pswarm-relay.service"))))
    unit = SYSTEMD / "p2pswarm-relay@.service"
    other = relay_settings(parse_cli(exec_start(unit.name, read_unit(unit))))
    assert other.identity != first.identity and "%i" in other.identity
    assert other.listen != first.listen and other.announce != first.announce and other.health != first.health
    assert other.bootstrap == [env_samples()["P2PSWARM_RELAY_ADDR"]]
    assert other.trust_issuer == first.trust_issuer and other.max_reservations == first.max_reservations



# -- relay.toml --------------------------------------------------------------------------------------
def test_relay_toml_loads_with_defaults_and_stated_values():
    s = load_settings(str(RELAY_TOML), {})
    defaults = RelaySettings()
    for f in fields(RelaySettings):
        expected = STATED.get(f.name, getattr(defaults, f.name))
        assert getattr(s, f.name) == expected, f"relay.toml {f.name} = {getattr(s, f.name)!r}, expected {expected!r}"


def test_relay_toml_names_and_explains_every_setting():
    text = RELAY_TOML.read_text()
    data = tomllib.loads(text)["relay"]
    lines = text.splitlines()
    for f in fields(RelaySettings):
        active = [i for i, ln in enumerate(lines) if re.match(rf"{f.name}\s*=", ln)]
        commented = [i for i, ln in enumerate(lines) if re.match(rf"#\s*{f.name}\s*=", ln)]
        assert len(active) + len(commented) >= 1, f"relay.toml does not mention {f.name}"
        if not active:
            assert f.name not in data and getattr(RelaySettings(), f.name) is None, \
                f"{f.name} is only commented out, but it has a default TOML can spell"
        i = (active or commented)[0]
        while i > 0 and re.match(r"#\s*\w+\s*=", lines[i - 1]):  # a group of commented-out keys
            i -= 1
        comment = []
        while i > 0 and lines[i - 1].startswith("#"):
            i -= 1
            comment.append(lines[i])
        assert len(" ".join(comment)) > 40, f"relay.toml: {f.name} has no comment explaining it"
        assert "default" in " ".join(comment).lower(), f"relay.toml: the comment on {f.name} names no default"
    # The commented-out keys are valid too, once filled in.
    uncommented = re.sub(r"(?m)^#\s*(tls_cert|tls_key)(\s*=)", r"\1\2", text)
    data = tomllib.loads(uncommented)["relay"]
    assert data["tls_cert"].endswith(".pem") and data["tls_key"].endswith(".pem")


def test_relay_toml_stated_values_fit_the_deployment():
    s = load_settings(str(RELAY_TOML), {})
    assert s.listen == ["/ip4/0.0.0.0/tcp/8080/ws"]  # plain ws for the CDN, unprivileged port
    assert all(a.endswith("/tcp/443/wss") for a in s.announce), "workers reach the CDN on 443"
    assert s.health.startswith("127.0.0.1:"), "health stays off the public interface"
    # Every worker sends a renewal at min(ttl/2, ttl-30) s: under the ~100 s a CDN leaves an idle WebSocket.
    assert min(s.reservation_ttl / 2, s.reservation_ttl - 30) < 100
    assert not s.open


@pytest.mark.slow
def test_unedited_relay_toml_is_refused_at_start(tmp_path):
    """The placeholder issuer stops the relay with one line, before any key or socket is made."""
    proc = run_cli("relay", "--config", str(RELAY_TOML), "--identity", str(tmp_path / "relay.key"),
                   "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}/ws", "--health", f"127.0.0.1:{free_port()}",
                   env={"P2PSWARM_HOME": str(tmp_path / "home")}, timeout=60)
    assert_one_line_error(proc, "REPLACE-WITH-YOUR-ISSUER", "not an Ed25519 peer id")
    assert not (tmp_path / "relay.key").exists()


# -- Containerfile -----------------------------------------------------------------------------------
def containerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in CONTAINERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        instr, _, rest = line.partition(" ")
        out.append((instr.upper(), rest.strip()))
    return out


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), rest
    return value


def final_stage() -> list[tuple[str, str]]:
    instrs = containerfile()
    starts = [i for i, (k, _) in enumerate(instrs) if k == "FROM"]
    return instrs[starts[-1]:]


def container_argv() -> list[str]:
    stage = final_stage()
    entry = [exec_form(r) for k, r in stage if k == "ENTRYPOINT"]
    cmd = [exec_form(r) for k, r in stage if k == "CMD"]
    assert entry and cmd, "ENTRYPOINT and CMD, exec form"
    return entry[-1] + cmd[-1]


def test_containerfile_cmd_parses_and_loads_its_config():
    argv = container_argv()
    assert argv[0] == "p2pswarm"
    args = parse_cli(argv[1:])
    assert args.command == "relay"
    copied = {r.split()[-1]: r.split()[-2] for k, r in final_stage() if k == "COPY" and "--from" not in r}
    assert copied.get(args.config) == "bootstrap/relay.toml", copied
    s = relay_settings(args)
    assert s.listen == ["/ip4/0.0.0.0/tcp/8080/ws"]


def test_containerfile_base_user_paths_ports_healthcheck():
    instrs = containerfile()
    froms = [r.split()[0] for k, r in instrs if k == "FROM"]
    assert froms and all(f == "python:3.11-slim" for f in froms), froms
    stage = final_stage()
    users = [r for k, r in stage if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "runs as a non-root user"
    # Every COPY from the build context names a file or folder of this repository.
    for k, r in instrs:
        if k == "COPY" and "--from" not in r:
            for src in r.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    # The project is installed from a fixed path, into a fixed virtual environment.
    runs = " ".join(r for k, r in instrs if k == "RUN")
    assert "pip install /opt/p2pswarm/src" in runs and "/opt/p2pswarm/venv" in runs
    assert any(k == "COPY" and r.split()[-1].startswith("/opt/p2pswarm/src") and "pyproject.toml" in r
               for k, r in instrs)
    env = " ".join(r for k, r in stage if k == "ENV")
    assert f"P2PSWARM_HOME={STATE_DIR}" in env
    assert any(k == "VOLUME" and STATE_DIR in r for k, r in stage), "the identity keys outlive the container"
    s = load_settings(str(RELAY_TOML), {})
    exposed = {int(p.split("/")[0]) for k, r in stage if k == "EXPOSE" for p in r.split()}
    assert {int(re.search(r"/tcp/(\d+)", a).group(1)) for a in s.listen} <= exposed, exposed
    hc = [r for k, r in stage if k == "HEALTHCHECK"]
    assert len(hc) == 1 and " CMD " in f" {hc[0]} "
    check = hc[0].split(" CMD ", 1)[1] if " CMD " in hc[0] else hc[0].split("CMD ", 1)[1]
    assert f"http://{s.health}/health" in " ".join(exec_form(check)), "HEALTHCHECK asks relay.toml's health address"


def healthcheck_argv(health: str) -> list[str]:
    hc = next(r for k, r in final_stage() if k == "HEALTHCHECK")
    argv = exec_form(hc.split("CMD ", 1)[1])
    default = load_settings(str(RELAY_TOML), {}).health
    argv = [a.replace(default, health) for a in argv]
    return [sys.executable if a == "python" else a for a in argv]


# -- docs/deploy.md ----------------------------------------------------------------------------------
DOC_SAMPLES = {
    "ISSUER_ID": "12D3KooWLiLpYbEzGp62viPpMaLQ3PKpxXx1a5mHBo9sB4x9DLiH",
    "RELAY_ID": "12D3KooWBDWSocG8K9SL9XCm1f2hpwhxGmoDF8Cxi4MBkwBBzerj",
    "SHARDS_ID": "12D3KooWBDWSocG8K9SL9XCm1f2hpwhxGmoDF8Cxi4MBkwBBzerj",
    "WORKER_ID": "12D3KooWLiLpYbEzGp62viPpMaLQ3PKpxXx1a5mHBo9sB4x9DLiH",
    "FINGERPRINT": "ab" * 32,
}


def doc_commands() -> list[str]:
    """`p2pswarm ...` lines of the shell blocks in docs/deploy.md (continuations joined)."""
    text = DEPLOY_MD.read_text()
    cmds = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            line = line.removeprefix("$ ")
            for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
                part = re.sub(r"^(sudo\s+-u\s+\S+\s+)?(\S+=\S+\s+)*", "", part.strip())
                if part.startswith(("p2pswarm ", VENV_BIN + " ")):
                    cmds.append(part)
    return cmds


def test_deploy_guide_commands_parse():
    cmds = doc_commands()
    assert len(cmds) >= 10, cmds
    seen = set()
    env = {**env_samples(), **DOC_SAMPLES}
    for cmd in cmds:
        line = re.sub(r"\$\((cat [^)]*)\)", "p2pswarm-token-v1:sample", cmd)  # $(cat token) and the like
        line = re.sub(r"\s+[12]?>.*$", "", line)  # redirections
        argv = shlex.split(substitute(line, env))
        args = parse_cli(argv[1:])
        seen.add(args.command if args.command != "token" else f"token {args.token_command}")
        if args.command == "relay" and args.config:
            relay_settings(args)
    for needed in ("relay", "bootstrap", "node", "identity", "token issue", "token show", "manifest",
                   "serve-shards", "fetch"):
        assert needed in seen, f"docs/deploy.md shows no `p2pswarm {needed}`"


# -- the real process ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_relay_starts_from_the_example_config_serves_health_and_stops(tmp_path):
    import httpx

    from p2pswarm.net.signed.identity import load_or_create_identity

    issuer = load_or_create_identity(tmp_path / "issuer.key").peer_id_str
    port, hport = free_port(), free_port()
    env = dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    log = tmp_path / "relay.log"
    args = ["relay", "--config", str(RELAY_TOML), "--listen", f"/ip4/127.0.0.1/tcp/{port}/ws",
            "--health", f"127.0.0.1:{hport}", "--identity", str(tmp_path / "relay.key"), "--trust-issuer", issuer]
    parse_cli(args)
    with open(log, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "p2pswarm.cli", *args], stdout=subprocess.PIPE,
                                stderr=log_file, stdin=subprocess.DEVNULL, text=True, env=env)
    try:
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        t.start()
        t.join(90)
        assert line and line[0].startswith("READY "), f"no READY line: {log.read_text()[-3000:]}"
        parts = line[0].split()
        relay_id = load_or_create_identity(tmp_path / "relay.key").peer_id_str
        # READY shows the announced (CDN) address from relay.toml, with the relay's peer id.
        assert parts[1] == f"{STATED['announce'][0]}/p2p/{relay_id}", parts
        assert parts[2] == f"health=http://127.0.0.1:{hport}/health", parts

        r = httpx.get(f"http://127.0.0.1:{hport}/health", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        h = r.json()
        assert h["status"] == "ok" and h["peer_id"] == relay_id and h["open"] is False
        assert h["reservations"] == 0 and h["circuits"] == 0
        s = load_settings(str(RELAY_TOML), {})
        assert h["limits"] == {k: getattr(s, k) for k in (
            "max_reservations", "max_circuits", "max_circuits_per_peer", "max_circuit_bytes",
            "max_circuit_duration", "reservation_ttl")}
        assert httpx.get(f"http://127.0.0.1:{hport}/nope", timeout=10).status_code == 404
        # The container's HEALTHCHECK command, pointed at this relay, passes.
        hc = subprocess.run(healthcheck_argv(f"127.0.0.1:{hport}"), check=False, capture_output=True, text=True, timeout=30)
        assert hc.returncode == 0, hc.stderr
        # The WebSocket port answers an HTTP upgrade the way a CDN origin must.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: relay.example.com\r\nUpgrade: websocket\r\n"
                         b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                         b"Sec-WebSocket-Version: 13\r\n\r\n")
            reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 101"), reply[:200]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"the relay did not stop within 30 s of SIGTERM: {log.read_text()[-3000:]}")
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "signal SIGTERM: shutting down" in text and "relay stopped" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.slow
def test_direct_443_command_serves_wss_to_a_relayed_worker(tmp_path, tiny_f32):
    """The drop-in's relay command line (its credentials a self-signed certificate, port 443 a free
    loopback port, the announce address /dns4/localhost/.../wss): a worker dials it by name over
    TLS, trusting the certificate through P2PSWARM_WSS_CA, shows its token and holds a reservation."""
    from p2pswarm.model.slicer import slice_experts
    from p2pswarm.net.signed.identity import load_or_create_identity
    from p2pswarm.net.signed.tokens import issue_token

    crt, pem = map(Path, make_cert(tmp_path, dns=("localhost",), files=("tls.crt", "tls.key"), cn="localhost"))
    port, hport = free_port(), free_port()
    issuer = load_or_create_identity(tmp_path / "issuer.key")
    entries = effective(SYSTEMD / "p2pswarm-relay.service")
    env_file = {**env_samples(), "CREDENTIALS_DIRECTORY": str(tmp_path)}
    argv = shlex.split(substitute(unit_values(entries, "ExecStart")[0], env_file))[1:]
    local = {"/etc/p2pswarm/relay.toml": str(RELAY_TOML),
             "/ip4/0.0.0.0/tcp/443/wss": f"/ip4/127.0.0.1/tcp/{port}/wss"}
    argv = [local.get(a, a) for a in argv]
    assert f"/ip4/127.0.0.1/tcp/{port}/wss" in argv, argv
    assert Path(argv[argv.index("--tls-cert") + 1]) == crt and Path(argv[argv.index("--tls-key") + 1]) == pem
    argv += ["--announce", f"/dns4/localhost/tcp/{port}/wss",
             "--health", f"127.0.0.1:{hport}", "--identity", str(tmp_path / "relay.key"),
             "--trust-issuer", issuer.peer_id_str]
    env = dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home"), P2PSWARM_KERNEL="numpy", PYTHONUNBUFFERED="1",
               P2PSWARM_WSS_CA=str(crt))
    relay = Proc(argv, tmp_path / "relay.log", env)
    worker = None
    try:
        relay_addr = relay.addr
        assert relay_addr.startswith(f"/dns4/localhost/tcp/{port}/wss/p2p/"), relay.ready
        shard = tmp_path / "shard.gguf"
        slice_experts(str(tiny_f32), str(shard), layers=(0, 2), experts=(0, 4))
        worker_id = load_or_create_identity(tmp_path / "worker.key")
        token = issue_token(issuer, worker_id.peer_id_str, ["relay"], 600).encode()
        worker = Proc(["node", "--role", "worker", "--shard", str(shard), "--relay", relay_addr,
                       "--token", token, "--identity", str(tmp_path / "worker.key")], tmp_path / "worker.log", env)
        assert worker.addr == f"{relay_addr}/p2p-circuit/p2p/{worker_id.peer_id_str}", worker.ready
        import httpx

        h = httpx.get(f"http://127.0.0.1:{hport}/health", timeout=10).json()
        assert h["reservations"] == 1 and h["tokens_accepted"] == 1, h
    finally:
        if worker is not None:
            assert worker.stop() == 0, worker.text()[-3000:]
        assert relay.stop() == 0, relay.text()[-3000:]
