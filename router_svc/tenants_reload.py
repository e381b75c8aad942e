"""Keep the router's tenant registry current: reload the tenants file on SIGHUP and when it changes.

A registry is immutable; a reload builds a whole new one off the event loop and swaps one reference,
so a request keeps the `Tenant` it authenticated as, and an edit that fails validation never
replaces a good registry (the old one stays, ``tenants_reload_failed`` is logged once per edit and
counted). The file is polled with `os.stat` (mtime, size, inode) every ``interval`` seconds and read
only when that changes; a content hash equal to the one served is no reload. Write the file
atomically (write a temporary file, rename it over), as Kubernetes ConfigMap volumes do, so a poll
never reads it half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pathlib
import signal

from services.logging import get_logger

from .metrics import TENANTS, TENANTS_RELOADS
from .tenants import Tenant, TenantRegistry, TenantsFileError

log = get_logger(__name__)

_Signature = tuple[int, int, int, int] | None


class TenantsReloader:
    """Owns the current `TenantRegistry` and the task that reloads it; `authenticate` reads through it.

    Construction loads the file and raises `TenantsFileError` when it is invalid (the router does not
    start on a bad file). `start()` installs the SIGHUP handler and the poll task; `close()` removes both.
    """

    def __init__(self, path: str | pathlib.Path, interval: float) -> None:
        if interval < 0:
            raise ValueError(f"tenants reload interval must be >= 0 seconds (0 = SIGHUP only), got {interval}")
        self.path = pathlib.Path(path)
        self.interval = interval
        self._signature = self._stat()
        data = self._read()
        self.registry = self._parse(data)
        self._digest = hashlib.sha256(data).digest()
        self.attempts = 0  # reloads tried (file changed or SIGHUP): tests and operators wait on it
        self._wake: asyncio.Event | None = None
        self._forced = False
        self._task: asyncio.Task[None] | None = None
        self._sighup = False
        self._lock = asyncio.Lock()  # one reload at a time: an older read must never swap in after a newer
        TENANTS.set(len(self.registry.tenants))

    def authenticate(self, api_key: str | None) -> Tenant:
        return self.registry.authenticate(api_key)

    def _stat(self) -> _Signature:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)

    def _read(self) -> bytes:
        try:
            return self.path.read_bytes()
        except OSError as exc:
            raise TenantsFileError(f"{self.path}: cannot read: {exc}") from None

    def _parse(self, data: bytes) -> TenantRegistry:
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            raise TenantsFileError(f"{self.path}: not UTF-8: {exc}") from None
        return TenantRegistry.from_text(text, str(self.path), toml=self.path.suffix == ".toml")

    def _load(self) -> tuple[bytes, TenantRegistry | None]:
        data = self._read()
        if hashlib.sha256(data).digest() == self._digest:
            return data, None
        return data, self._parse(data)

    async def reload(self, *, force: bool = False) -> bool:
        """Re-read the file if it changed (or ``force``); swap it in when valid. True when swapped."""
        async with self._lock:
            return await self._reload(force)

    async def _reload(self, force: bool) -> bool:
        signature = self._stat()
        if not force and signature == self._signature:
            return False
        self._signature = signature
        self.attempts += 1
        try:
            # YAML of many tenants parses in tens of ms: off the loop, so requests keep flowing.
            data, registry = await asyncio.to_thread(self._load)
        except TenantsFileError as exc:
            TENANTS_RELOADS.labels("failed").inc()
            log.error("tenants_reload_failed", path=str(self.path), error=str(exc),
                      kept=len(self.registry.tenants))
            return False
        if registry is None:
            log.info("tenants_unchanged", path=str(self.path), tenants=len(self.registry.tenants))
            return False
        old = {t.name: t for t in self.registry.tenants}
        new = {t.name: t for t in registry.tenants}
        self.registry, self._digest = registry, hashlib.sha256(data).digest()
        TENANTS_RELOADS.labels("ok").inc()
        TENANTS.set(len(new))
        log.info("tenants_reloaded", path=str(self.path), tenants=len(new),
                 added=len(new.keys() - old.keys()), removed=len(old.keys() - new.keys()),
                 changed=sum(1 for name in new.keys() & old.keys() if new[name] != old[name]))
        return True

    def _on_sighup(self) -> None:
        self._forced = True
        if self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup = True
        except (AttributeError, NotImplementedError, RuntimeError) as exc:  # no SIGHUP, or not the main thread
            log.warning("tenants_sighup_unavailable", error=str(exc))
        self._task = asyncio.create_task(self._run(), name="tenants-reloader")

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval or None)
            self._wake.clear()
            forced, self._forced = self._forced, False
            try:
                await self.reload(force=forced)
            except Exception:  # the reloader outlives any one bad reload
                TENANTS_RELOADS.labels("failed").inc()
                log.exception("tenants_reload_failed", path=str(self.path))

    async def close(self) -> None:
        if self._sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
