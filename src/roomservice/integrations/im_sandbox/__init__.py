"""A local stand-in for Tencent Cloud IM: the same REST subset at the same paths, state in
memory (and on disk with ``state_dir``: :mod:`.journal`), and a control API
(``/_sandbox/...``) to inject outages, error codes and latency and to read what was
delivered. See :mod:`.state` for the semantics and :mod:`.app` for
the control API.

    async with running_sandbox(sdk_app_id, secret_key) as sandbox:
        client = TencentImClient(base_url=sandbox.base_url, ...)
        sandbox.state.inject_error("send_group_msg", 10002, count=1)
"""

from roomservice.integrations.im_sandbox.app import create_app
from roomservice.integrations.im_sandbox.journal import SandboxJournal, SandboxStateInUse, state_file
from roomservice.integrations.im_sandbox.server import RunningSandbox, run_sandbox, running_sandbox
from roomservice.integrations.im_sandbox.state import (
    C2CMessage,
    Group,
    GroupMessage,
    InjectedError,
    RequestRecord,
    SandboxState,
)

__all__ = [
    "C2CMessage",
    "Group",
    "GroupMessage",
    "InjectedError",
    "RequestRecord",
    "RunningSandbox",
    "SandboxJournal",
    "SandboxState",
    "SandboxStateInUse",
    "create_app",
    "run_sandbox",
    "running_sandbox",
    "state_file",
]
