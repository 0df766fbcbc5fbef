"""The versions record on both backends (a SQLite file and a real PostgreSQL server): compare-and-set,
history, reset, the replicas' reports, and migrations applied once."""

from __future__ import annotations

import threading

import pytest

from riskserve.platform.errors import ConfigError, Conflict
from riskserve.state.db import Migration, open_database, redact
from riskserve.state.versions import ModelVersions, VersionEntry, VersionsRecord, VersionsStore


def _entry(version: str, source: str = "swap") -> VersionEntry:
    return VersionEntry(artifact=f"/artifacts/{version}", version=version, source=source, at=1.0)  # type: ignore[arg-type]


def test_an_empty_pipeline_reads_generation_zero_and_serves_the_yaml(state_dsn: str) -> None:
    store = VersionsStore(open_database(state_dsn))
    record = store.read("p")
    assert record.generation == 0
    assert store.generation("p") == 0
    assert record.serving("fraud", "/yaml/fraud") is None


def test_compare_and_set_moves_the_generation_and_refuses_a_stale_writer(state_dsn: str) -> None:
    store = VersionsStore(open_database(state_dsn))
    first = VersionsRecord(pipeline="p", models={"fraud": ModelVersions(base="/yaml", entries=[_entry("a")])})
    stored = store.compare_and_set(first, 0)
    assert stored.generation == 1
    assert store.generation("p") == 1
    with pytest.raises(Conflict, match="generation 0"):
        store.compare_and_set(first, 0)  # a second writer that read generation 0 loses
    second = stored.model_copy(deep=True)
    second.models["fraud"].entries.append(_entry("b"))
    assert store.compare_and_set(second, 1).generation == 2
    read = store.read("p")
    assert read.generation == 2
    assert [e.version for e in read.models["fraud"].entries] == ["a", "b"]
    assert read.serving("fraud", "/yaml") == _entry("b")
    assert read.serving("fraud", "/another-yaml-artifact") is None  # the YAML names another: it wins


def test_concurrent_writers_apply_every_change_exactly_once(state_dsn: str) -> None:
    db = open_database(state_dsn)
    store = VersionsStore(db)
    store.compare_and_set(VersionsRecord(pipeline="p", models={"m": ModelVersions(base="/y")}), 0)

    def append(n: int) -> None:
        while True:
            record = store.read("p")
            record.models["m"].entries.append(_entry(f"v{n}"))
            try:
                store.compare_and_set(record, record.generation)
                return
            except Conflict:
                continue

    threads = [threading.Thread(target=append, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = store.read("p")
    assert record.generation == 9
    assert sorted(e.version for e in record.models["m"].entries) == sorted(f"v{n}" for n in range(8))


def test_reset_forgets_every_version_and_still_moves_the_generation(state_dsn: str) -> None:
    store = VersionsStore(open_database(state_dsn))
    assert store.reset("p") == 0
    store.compare_and_set(
        VersionsRecord(pipeline="p", models={"m": ModelVersions(base="/y", entries=[_entry("a")])}), 0
    )
    assert store.reset("p") == 1
    record = store.read("p")
    assert record.models == {}
    assert record.generation == 2  # watchers see a change and go back to the YAML's artifacts


def test_replicas_report_and_age_out(state_dsn: str) -> None:
    store = VersionsStore(open_database(state_dsn))
    store.report("p", "r1", node="n1", models=["fraud"], generation=3, serving={"fraud": "a"})
    store.report(
        "p", "r2", node="n2", models=["fraud"], generation=2, serving={"fraud": "b"}, error="refused"
    )
    store.report("p", "r1", node="n1", models=["fraud"], generation=4, serving={"fraud": "c"})
    live = store.replicas("p", seen_within_s=60)
    assert [(r.replica, r.generation, r.serving, r.error) for r in live] == [
        ("r1", 4, {"fraud": "c"}, ""),
        ("r2", 2, {"fraud": "b"}, "refused"),
    ]
    store.forget("p", "r2")
    assert [r.replica for r in store.replicas("p", seen_within_s=60)] == ["r1"]
    assert store.replicas("p", seen_within_s=-1) == []  # nobody reported in the future


def test_migrations_apply_once_and_a_newer_schema_is_refused(state_dsn: str) -> None:
    db = open_database(state_dsn)
    steps = [Migration(1, "CREATE TABLE t (x BIGINT)"), Migration(2, "ALTER TABLE t ADD COLUMN y TEXT")]
    assert db.migrate("demo", steps) == 2
    assert db.migrate("demo", steps) == 2  # applied once: a second CREATE TABLE would fail
    with db.transaction() as tx:
        tx.execute("INSERT INTO t (x, y) VALUES (?, ?)", (1, "one"))
    with pytest.raises(ConfigError, match="'demo' is at schema 2, this code reads up to 1"):
        db.migrate("demo", steps[:1])


def test_a_failed_transaction_writes_nothing(state_dsn: str) -> None:
    db = open_database(state_dsn)
    db.migrate("demo", [Migration(1, "CREATE TABLE t (x BIGINT)")])

    def half_way() -> None:
        with db.transaction() as tx:
            tx.execute("INSERT INTO t (x) VALUES (?)", (1,))
            raise RuntimeError("half way")

    with pytest.raises(RuntimeError):
        half_way()
    with db.transaction() as tx:
        assert tx.one("SELECT COUNT(*) FROM t") == (0,)


def test_a_dsn_password_is_never_shown() -> None:
    assert redact("postgresql://risk:s3cret@db:5432/risk") == "postgresql://risk:***@db:5432/risk"
    assert "s3cret" not in redact("host=db password=s3cret dbname=risk")
    assert "s3cret" not in repr(open_database("postgresql://risk:s3cret@127.0.0.1:1/risk"))
    with pytest.raises(ConfigError, match=r"\*\*\*") as error:
        open_database("mysql://risk:s3cret@db/risk")
    assert "s3cret" not in str(error.value)
