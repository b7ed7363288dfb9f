"""Settings: flags > env > TOML file > defaults; bad values are readable ConfigErrors."""

from __future__ import annotations

import textwrap

import pytest

from maasd.errors import ConfigError
from maasd.settings import ENV, Settings, load


def write(tmp_path, text: str, name: str = "maasd.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def config(tmp_path):
    return write(
        tmp_path,
        f"""
        host = "10.0.0.1"
        port = 3000
        data_dir = "{tmp_path}/from-file"
        max_ttl_s = 60

        [[pools]]
        name = "fast"
        numa_node = 0
        capacity_bytes = 8589934592
        latency_us = 1

        [[pools]]
        name = "kv-persist"
        numa_node = 1
        capacity_bytes = 2147483648
        persistence = "persistent"
        scrub = "punch"
        spill_dir = "/var/lib/maasd/spill"
    """,
    )


class TestPrecedence:
    def test_defaults_without_anything(self):
        s = load(flags={}, env={})
        assert (s.host, s.port, s.pools) == ("127.0.0.1", 7878, [])
        assert s.socket_path.endswith("maasd.sock")
        assert s.database_url.startswith("sqlite:///")

    def test_file_beats_defaults(self, config, tmp_path):
        s = load(flags={"config": config}, env={})
        assert (s.host, s.port, s.max_ttl_s) == ("10.0.0.1", 3000, 60)
        assert s.data_dir == f"{tmp_path}/from-file"

    def test_env_beats_file(self, config):
        s = load(flags={}, env={"MAASD_CONFIG": config, "MAASD_PORT": "4000"})
        assert s.port == 4000  # env string converted to int
        assert s.host == "10.0.0.1"  # untouched by env: from the file

    def test_flags_beat_env_and_file(self, config):
        s = load(
            flags={"config": config, "port": 5000, "host": "0.0.0.0"},
            env={"MAASD_PORT": "4000", "MAASD_HOST": "10.9.9.9"},
        )
        assert (s.port, s.host) == (5000, "0.0.0.0")

    def test_none_flags_are_ignored(self, config):
        s = load(flags={"config": config, "port": None}, env={"MAASD_PORT": "4000"})
        assert s.port == 4000

    def test_empty_env_value_is_ignored(self, config):
        s = load(flags={"config": config}, env={"MAASD_PORT": ""})
        assert s.port == 3000

    def test_config_flag_beats_config_env(self, tmp_path, config):
        other = write(tmp_path, "port = 1234\n", "other.toml")
        assert load(flags={"config": other}, env={"MAASD_CONFIG": config}).port == 1234

    def test_every_env_var_maps_to_a_field(self):
        fields = set(Settings.__struct_fields__)
        assert set(ENV.values()) <= fields
        for var in (
            "MAASD_HOST",
            "MAASD_PORT",
            "MAASD_SOCKET",
            "MAASD_DATA_DIR",
            "MAASD_DB_URL",
            "MAASD_CONFIG",
            "MAASD_ADMIN_KEY",
            "MAASD_DEFAULT_POOL_BYTES",
            "MAASD_MAX_TTL_S",
        ):
            assert var in ENV

    def test_env_strings_convert(self, tmp_path):
        s = load(
            flags={},
            env={
                "MAASD_DEFAULT_POOL_BYTES": "1073741824",
                "MAASD_REAPER_INTERVAL_S": "0.5",
                "MAASD_SOCKET": str(tmp_path / "s.sock"),
                "MAASD_DB_URL": "postgresql+asyncpg://u@h/db",
            },
        )
        assert s.default_pool_bytes == 1 << 30
        assert s.reaper_interval_s == 0.5
        assert s.socket_path == str(tmp_path / "s.sock")
        assert s.database_url == "postgresql+asyncpg://u@h/db"

    def test_data_dir_user_expanded(self):
        s = load(flags={"data_dir": "~/maasd-test"}, env={})
        assert not s.data_dir.startswith("~")


class TestPools:
    def test_pools_from_toml(self, config):
        pools = load(flags={"config": config}, env={}).pools
        assert [p.name for p in pools] == ["fast", "kv-persist"]
        fast, persist = pools
        assert (
            fast.numa_node,
            fast.capacity_bytes,
            fast.backing,
            fast.persistence,
            fast.scrub,
            fast.prefault,
        ) == (0, 8 << 30, "memfd", "volatile", "zero", True)
        assert (persist.numa_node, persist.persistence, persist.scrub, persist.spill_dir) == (
            1,
            "persistent",
            "punch",
            "/var/lib/maasd/spill",
        )

    def test_duplicate_pool_names_refused(self, tmp_path):
        path = write(
            tmp_path,
            """
            [[pools]]
            name = "a"
            numa_node = 0
            capacity_bytes = 4096
            [[pools]]
            name = "a"
            numa_node = 0
            capacity_bytes = 8192
        """,
        )
        with pytest.raises(ConfigError, match="duplicate pool names"):
            load(flags={"config": path}, env={})

    @pytest.mark.parametrize(
        ("pool", "words"),
        [
            ('backing = "ramdisk"', ["backing"]),
            ('persistence = "forever"', ["persistence"]),
            ('scrub = "shred"', ["scrub"]),
            ('capacity_bytes = "lots"', ["capacity_bytes"]),
            ('colour = "blue"', ["colour"]),
        ],
    )
    def test_bad_pool_field(self, tmp_path, pool, words):
        base = {"name": '"p"', "numa_node": "0", "capacity_bytes": "4096"}
        key = pool.split(" = ")[0]
        base[key] = pool.split(" = ")[1]
        body = "\n".join(f"{k} = {v}" for k, v in base.items())
        path = write(tmp_path, f"[[pools]]\n{body}\n")
        with pytest.raises(ConfigError) as exc:
            load(flags={"config": path}, env={})
        for w in words:
            assert w in exc.value.detail

    @pytest.mark.parametrize("name", ["0" * 32, "0" * 33, "0123456789ABCDEF" * 2, "node0"])
    def test_pool_names_of_hex_digits_accepted(self, tmp_path, name):
        path = write(
            tmp_path, f'[[pools]]\nname = "{name}"\nnuma_node = 0\ncapacity_bytes = 4096\n'
        )
        assert [p.name for p in load(flags={"config": path}, env={}).pools] == [name]

    def test_pool_missing_name(self, tmp_path):
        path = write(tmp_path, "[[pools]]\nnuma_node = 0\ncapacity_bytes = 4096\n")
        with pytest.raises(ConfigError, match="name"):
            load(flags={"config": path}, env={})


class TestBadValues:
    @pytest.mark.parametrize(
        ("env", "word"),
        [
            ({"MAASD_PORT": "seventy"}, "port"),
            ({"MAASD_PORT": "0"}, "port"),
            ({"MAASD_PORT": "70000"}, "port"),
            ({"MAASD_PORT": "-1"}, "port"),
            ({"MAASD_MAX_TTL_S": "0"}, "max_ttl_s"),
            ({"MAASD_MAX_TTL_S": "soon"}, "max_ttl_s"),
            ({"MAASD_REAPER_INTERVAL_S": "fast"}, "reaper_interval_s"),
            ({"MAASD_REAPER_INTERVAL_S": "0"}, "reaper_interval_s"),
            ({"MAASD_HOST_TIMEOUT_S": "2", "MAASD_REAPER_INTERVAL_S": "1"}, "host_timeout_s"),
            ({"MAASD_DB_POOL_SIZE": "0"}, "db_pool_size"),
            ({"MAASD_DB_MAX_OVERFLOW": "-1"}, "db_max_overflow"),
        ],
    )
    def test_bad_env(self, env, word):
        with pytest.raises(ConfigError) as exc:
            load(flags={}, env=env)
        assert word in exc.value.detail
        assert exc.value.detail.startswith("settings")

    def test_bad_flag(self):
        with pytest.raises(ConfigError, match="port"):
            load(flags={"port": "http"}, env={})

    def test_unknown_key_in_file(self, tmp_path):
        path = write(tmp_path, 'colour = "blue"\n')
        with pytest.raises(ConfigError, match="colour"):
            load(flags={"config": path}, env={})

    def test_wrong_type_in_file(self, tmp_path):
        path = write(tmp_path, 'port = "x"\n')
        with pytest.raises(ConfigError, match="port"):
            load(flags={"config": path}, env={})

    @pytest.mark.parametrize("pools", ["3", '"p"', "{ name = 'p' }", "[1, 2]", "true"])
    def test_pools_that_are_not_tables(self, tmp_path, pools):
        path = write(tmp_path, f"pools = {pools}\n")
        with pytest.raises(ConfigError, match="pools"):
            load(flags={"config": path}, env={})

    def test_broken_toml(self, tmp_path):
        path = write(tmp_path, "port = = 1\n[[pools\n")
        with pytest.raises(ConfigError) as exc:
            load(flags={"config": path}, env={})
        assert path in exc.value.detail

    def test_missing_file(self, tmp_path):
        missing = str(tmp_path / "nope.toml")
        with pytest.raises(ConfigError) as exc:
            load(flags={}, env={"MAASD_CONFIG": missing})
        assert missing in exc.value.detail


def test_a_nul_byte_in_a_path_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot hold a NUL byte"):
        load({"config": f"{tmp_path}/a\x00b"}, env={})
    with pytest.raises(ConfigError, match="data_dir cannot hold a NUL byte"):
        load({"data_dir": "/var/lib/a\x00b"}, env={})
    path = write(tmp_path, 'socket = "/run/a\\u0000b"\n')
    with pytest.raises(ConfigError, match="socket cannot hold a NUL byte"):
        load(env={"MAASD_CONFIG": path})
    path = write(
        tmp_path,
        """
        [[pools]]
        name = "p"
        numa_node = 0
        capacity_bytes = 4096
        persistence = "persistent"
        spill_dir = "/x\\u0000"
        """,
    )
    with pytest.raises(ConfigError, match="spill_dir"):
        load(env={"MAASD_CONFIG": path})


def test_limits_settings(tmp_path) -> None:
    settings = load(
        env={"MAASD_MAX_BUFFERS_PER_TENANT": "100", "MAASD_ADMIN_KEY_FILE": f"{tmp_path}/key"}
    )
    assert settings.max_buffers_per_tenant == 100
    assert settings.admin_key_file == f"{tmp_path}/key"
    assert load(env={}).max_buffers_per_tenant == 4096
    for bad in ("0", str(1 << 30)):
        with pytest.raises(ConfigError, match="max_buffers_per_tenant"):
            load(env={"MAASD_MAX_BUFFERS_PER_TENANT": bad})


class TestSizes:
    """Sizes a person types take units; a bad one names where it came from."""

    def test_env_default_pool_bytes_with_a_unit(self):
        assert load(env={"MAASD_DEFAULT_POOL_BYTES": "1GiB"}).default_pool_bytes == 1 << 30
        assert load(env={"MAASD_DEFAULT_POOL_BYTES": "268435456"}).default_pool_bytes == 1 << 28

    def test_config_capacity_with_a_unit(self, tmp_path):
        path = write(
            tmp_path,
            """
            default_pool_bytes = "512MiB"

            [[pools]]
            name = "fast"
            numa_node = 0
            capacity_bytes = "8GiB"

            [[pools]]
            name = "plain"
            numa_node = 0
            capacity_bytes = 4096
            """,
        )
        s = load(flags={"config": path}, env={})
        assert s.default_pool_bytes == 512 << 20
        assert [p.capacity_bytes for p in s.pools] == [8 << 30, 4096]

    @pytest.mark.parametrize(
        ("value", "says"),
        [("1Gx", "'1Gx': unknown unit"), ("1G", "ambiguous"), ("-1GiB", "negative")],
    )
    def test_a_bad_env_size_names_the_variable(self, value, says):
        with pytest.raises(ConfigError) as info:
            load(env={"MAASD_DEFAULT_POOL_BYTES": value})
        assert info.value.detail.startswith(f"MAASD_DEFAULT_POOL_BYTES: '{value}'")
        assert says in info.value.detail

    def test_a_bad_config_size_names_the_file_and_the_pool(self, tmp_path):
        path = write(tmp_path, '[[pools]]\nname = "x"\nnuma_node = 0\ncapacity_bytes = "8 gigs"\n')
        with pytest.raises(ConfigError) as info:
            load(flags={"config": path}, env={})
        assert info.value.detail.startswith(f"{path}: pools[0].capacity_bytes: '8 gigs'")


def test_the_ledger_and_l2_bounds_are_checked_at_load() -> None:
    s = load(env={"MAASD_DB_CONNECT_TIMEOUT_S": "1.5", "MAASD_L2_MAX_VALUE_BYTES": "64MiB"})
    assert (s.db_connect_timeout_s, s.db_statement_timeout_s) == (1.5, 10.0)
    assert s.l2_max_value_bytes == 64 << 20
    assert s.l2_min_bytes_per_s == 100 << 20
    for env in (
        {"MAASD_DB_CONNECT_TIMEOUT_S": "0"},
        {"MAASD_DB_STATEMENT_TIMEOUT_S": "-1"},
        {"MAASD_L2_MAX_VALUE_BYTES": "0"},
        {"MAASD_L2_MIN_BYTES_PER_S": "0"},
    ):
        with pytest.raises(ConfigError):
            load(env=env)
