"""`--access-log/--no-access-log`: uvicorn's line per request, on unless the operator turns it off (issue 46)."""

from __future__ import annotations

import pytest

from cobali.config import settings
from cobali.config.serve_flags import server_config
from cobali.faces import cli
from cobali.http import serve as serve_module
from tests.unit.http.test_server_api import fake_app, fake_engine


@pytest.mark.parametrize(("flags", "logged"), [([], True), (["--no-access-log"], False), (["--access-log"], True)])
def test_the_flag_reaches_uvicorn(flags: list[str], logged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    args = settings.parse_args(cli.build_parser(), ["serve", "--model", "/nonexistent/m.gguf", *flags])
    monkeypatch.setattr(serve_module.signal, "signal", lambda *_args: None)  # the server is built, not run
    server = serve_module._server(fake_app(fake_engine()), server_config(args), on_exit=lambda: None)
    assert server.config.access_log is logged
