"""The CURVE key files: written once, readable only by their user, read back or refused in one line."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from instrumented_ddp.wire.curve_keys import (CLIENT_FILE, SERVER_FILE, ClientKeys, ServerKeys, load_client_keys,
                                              load_server_keys, write_key_files)


def test_the_two_files_are_each_half_of_the_pairs_and_only_their_user_reads_them(tmp_path: Path) -> None:
    write_key_files(tmp_path / "keys", ("server-public", "server-secret"), ("client-public", "client-secret"))
    assert load_server_keys(tmp_path / "keys" / SERVER_FILE) == ServerKeys("server-public", "server-secret", "client-public")
    assert load_client_keys(str(tmp_path / "keys" / CLIENT_FILE)) == ClientKeys("server-public", "client-public", "client-secret")
    assert {stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "keys").iterdir()} == {0o600}
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    with pytest.raises(FileExistsError):  # never overwritten: the training nodes hold the client half
        write_key_files(tmp_path / "keys", ("a", "b"), ("c", "d"))


def test_a_server_key_file_others_may_read_is_refused_in_one_line(tmp_path: Path) -> None:
    write_key_files(tmp_path, ("sp", "ss"), ("cp", "cs"))
    (tmp_path / SERVER_FILE).chmod(0o640)
    with pytest.raises(ValueError, match=f"^{tmp_path / SERVER_FILE} is readable by other users; chmod 600 it$"):
        load_server_keys(tmp_path / SERVER_FILE)


@pytest.mark.parametrize("text", ["[]", "{", '{"server_public": "sp"}'], ids=["a-list", "not-json", "a-key-missing"])
def test_a_client_key_file_that_is_not_one_is_refused_in_one_line(tmp_path: Path, text: str) -> None:
    (tmp_path / CLIENT_FILE).write_text(text)
    with pytest.raises(ValueError, match=f"^cannot read CURVE client keys from {tmp_path / CLIENT_FILE}: "):
        load_client_keys(str(tmp_path / CLIENT_FILE))
