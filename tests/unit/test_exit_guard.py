"""The exit guard sees gloo's threads (also after destroy_process_group, while DDP holds the
group), and holds back finalization only then. ``phalanx run``'s workers get it from a start-up
hook that imports no torch and puts PYTHONPATH and ``sys.path`` back as they were.

The race it closes: tools/exit_race, tests/e2e/test_exit_race.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from phalanx.comm import exit_guard
from phalanx.launch.worker_site import HOOK_DIR, USER_PYTHONPATH_ENV, site_env, sitecustomize

SCRIPT = """
import os, tempfile, time
import torch, torch.distributed as dist
import phalanx
from phalanx.comm import exit_guard
print("before", exit_guard._gloo_threads_alive())
path = os.path.join(tempfile.mkdtemp(), "rdzv")
dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
model = phalanx.DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
dist.destroy_process_group()
print("after", exit_guard._gloo_threads_alive())
start = time.monotonic()
exit_guard._let_gloo_threads_finish()
print("held", round(time.monotonic() - start, 3))
"""

SHOW = """
import json, os, sys
hooked = sys.modules.get("_phalanx_exit_guard")
print(json.dumps({
    "PYTHONPATH": os.environ.get("PYTHONPATH"),
    "kept": os.environ.get("PHALANX_USER_PYTHONPATH"),
    "hook_on_path": HOOK in sys.path,
    "guard": getattr(hooked, "_installed", None),
    "torch": "torch" in sys.modules,
    "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
    "user_site_ran": os.environ.get("USER_SITE_RAN"),
}))
"""


def test_the_guard_sees_gloo_threads_only_when_there_are_some() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[:4] == ["before", "False", "after", "True"], out
    assert out[4] == "held" and float(out[5]) >= 0.05, out


def test_site_env_puts_the_hook_first_and_keeps_the_users_pythonpath() -> None:
    assert site_env({}) == {"PYTHONPATH": HOOK_DIR}
    assert site_env({"PYTHONPATH": ""}) == {"PYTHONPATH": HOOK_DIR, USER_PYTHONPATH_ENV: ""}
    assert site_env({"PYTHONPATH": "/a:/b"}) == {
        "PYTHONPATH": f"{HOOK_DIR}{os.pathsep}/a:/b",
        USER_PYTHONPATH_ENV: "/a:/b",
    }
    assert site_env({"PYTHONPATH": "/a", exit_guard.ENABLE_ENV: "0"}) == {}
    assert site_env({exit_guard.ENABLE_ENV: " Off"}) == {}
    assert site_env({exit_guard.ENABLE_ENV: "1"}) == {"PYTHONPATH": HOOK_DIR}
    assert sitecustomize.GUARD_NAME == exit_guard.HOOKED_NAME


def _show(base: dict[str, str], *flags: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", exit_guard.ENABLE_ENV)}
    env.update(base)
    env.update(site_env(base))
    code = f"HOOK = {HOOK_DIR!r}\n{SHOW}"
    done = subprocess.run(
        [sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return dict(json.loads(done.stdout))


def test_the_hook_installs_the_guard_without_torch_and_leaves_the_environment_as_it_was() -> None:
    for user in (None, "", "/nowhere/a"):
        shown = _show({} if user is None else {"PYTHONPATH": user})
        assert shown["PYTHONPATH"] == user and shown["kept"] is None, shown
        assert shown["hook_on_path"] is False and shown["guard"] is True, shown
        assert shown["torch"] is False, shown
    assert _show({exit_guard.ENABLE_ENV: "0"})["guard"] is None


def test_the_hook_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.environ['USER_SITE_RAN'] = os.environ.get('PYTHONPATH', 'unset')\n"
    )
    shown = _show({"PYTHONPATH": str(tmp_path)})
    assert shown["user_site_ran"] == str(tmp_path), shown  # it saw the user's PYTHONPATH
    assert shown["sitecustomize"] == str(tmp_path / "sitecustomize.py"), shown
    assert shown["guard"] is True, shown


def test_importing_phalanx_after_the_hook_does_not_install_a_second_guard() -> None:
    code = (
        "import sys, phalanx\nfrom phalanx.comm import exit_guard\n"
        "print(exit_guard._installed, sys.modules['_phalanx_exit_guard']._installed)"
    )
    env = {k: v for k, v in os.environ.items() if k != exit_guard.ENABLE_ENV}
    env.update(site_env(env))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr
