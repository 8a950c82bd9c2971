"""A run spread over several devices at once (``--devices``): one worker per device slot,
the (implementation, cases) units handed out as slots free up.

- :func:`~.config.check_devices`: the ``--devices`` text, checked against ``--device`` (no machine
  query): ``cpu:N`` with ``cpu``; ``all`` or ``0,1,...`` (indices or UUIDs, as
  ``CUDA_VISIBLE_DEVICES`` takes them) with ``cuda``.
- :func:`device_slots`: the slots on this machine. A GPU slot's workers see only their GPU
  (``CUDA_VISIBLE_DEVICES=<entry>``, so they use ``cuda``), and the parent judges its
  results on the same GPU (``cuda:P``, P its position among the GPUs the parent sees).
  A CPU slot is a worker of its own on the shared CPU (its timings contend with the
  others': docs/running.md).
- :func:`spread`: one thread per slot; a signal in the main thread, or a thread's error,
  cancels every worker (:meth:`~.protocol.Supervisor.cancel`) before it propagates.

Each GPU entry is checked against the GPUs this process may use
(:func:`~.devices.visible_gpus`). nvidia-smi numbers GPUs in PCI bus order; the CUDA
runtime does too only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (the CLI sets it when it is
unset), so a UUID is recorded for an index only then.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pagedbench.reference import PagedValueError

from pagedbench.harness.run.devices import nvidia_smi_uuids, visible_gpus
from pagedbench.harness.run.config import check_devices
from pagedbench.harness.run.protocol import Cancelled, Supervisor

Unit = TypeVar("Unit")


@dataclass(frozen=True)
class DeviceSlot:
    """One place where a spread run's workers run.

    Attributes
    ----------
    worker_device : str
        The torch device its workers use: ``"cpu"``, or ``"cuda"`` (the one GPU their
        ``CUDA_VISIBLE_DEVICES`` leaves them).
    judge_device : str
        Where the parent judges their results: ``"cpu"`` or ``"cuda:P"``.
    index : str
        Recorded as ``env.device_index``: the GPU's ``CUDA_VISIBLE_DEVICES`` entry, or
        the CPU worker's number (``"0"``, ``"1"``, ...).
    uuid : str or None
        The GPU's UUID (``env.device_uuid``), when known.
    visible : str or None
        The workers' ``CUDA_VISIBLE_DEVICES`` (None on the CPU).
    """

    worker_device: str
    judge_device: str
    index: str
    uuid: str | None = None
    visible: str | None = None

    def environment(self) -> dict[str, str]:
        """What this slot adds to a worker's environment."""
        return {} if self.visible is None else {"CUDA_VISIBLE_DEVICES": self.visible}


def device_slots(devices: str, device: str, gpus: Sequence[str] | None = None,
                 uuids: Mapping[str, str] | None = None,
                 environ: Mapping[str, str] | None = None) -> list[DeviceSlot]:
    """The slots ``--devices`` names on this machine (``[]`` for ``""``: one worker at a
    time, on ``device``). ``gpus`` (default :func:`~.devices.visible_gpus`), ``uuids``
    (default :func:`~.devices.nvidia_smi_uuids`) and ``environ`` (default this process's)
    are for tests.

    Raises
    ------
    PagedValueError
        As :func:`check_devices`; or naming ``--devices`` and the GPUs this process may
        use, when an entry is not among them or there are none.
    """
    check_devices(devices, device)
    if not devices:
        return []
    if device == "cpu":
        return [DeviceSlot("cpu", "cpu", str(i)) for i in range(int(devices[4:]))]
    gpus = visible_gpus() if gpus is None else list(gpus)
    if not gpus:
        raise PagedValueError("--devices", devices, "GPUs this machine has",
                              f"--devices {devices}: this process may use no GPU "
                              "(CUDA_VISIBLE_DEVICES is empty, or nvidia-smi lists none)")
    chosen = gpus if devices == "all" else devices.split(",")
    absent = [e for e in chosen if e not in gpus]
    if absent:
        raise PagedValueError("--devices", devices, f"among {gpus}",
                              f"--devices {devices}: {absent} not among the GPUs this "
                              f"process may use {gpus}")
    environ = os.environ if environ is None else environ
    pci_order = environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    if uuids is None:
        uuids = nvidia_smi_uuids() if pci_order else {}
    return [DeviceSlot("cuda", f"cuda:{gpus.index(e)}", e, visible=e,
                       uuid=e if e.startswith(("GPU-", "MIG-")) else
                       (uuids.get(e) if pci_order else None))
            for e in chosen]


class Stop:
    """The stop of a spread run: once :meth:`stop` is called, every supervisor
    :meth:`watching` has or will have is cancelled, and :meth:`check` raises."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._active: set[Supervisor] = set()

    def stop(self) -> None:
        """Cancel every worker of the run, now and from now on (idempotent)."""
        with self._lock:
            self._stopped = True
            active = list(self._active)
        for supervisor in active:
            supervisor.cancel()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped

    def check(self) -> None:
        """Raises :class:`~.protocol.Cancelled` once the run has stopped."""
        if self._stopped:
            raise Cancelled("the run stopped")

    @contextlib.contextmanager
    def watching(self, supervisor: Supervisor) -> Iterator[Supervisor]:
        """A context in which :meth:`stop` cancels ``supervisor`` (at once if it came
        first)."""
        with self._lock:
            self._active.add(supervisor)
            stopped = self._stopped
        if stopped:
            supervisor.cancel()
        try:
            yield supervisor
        finally:
            with self._lock:
                self._active.discard(supervisor)


def spread(units: Sequence[Unit], slots: Sequence[DeviceSlot],
           work: Callable[[Unit, DeviceSlot, Stop], None]) -> None:
    """Call ``work(unit, slot, stop)`` for every unit, in order, one thread per slot, each
    taking the next unit when it is free. ``work`` starts its workers under
    ``stop.watching`` and checks ``stop`` before it records anything.

    Raises
    ------
    BaseException
        A signal's exception in the main thread (:class:`~.runner.Interrupted`), or the
        first error of a thread, once every thread has ended (the other workers
        cancelled first).
    """
    pending, lock = deque(units), threading.Lock()
    stop = Stop()
    errors: list[BaseException] = []

    def take() -> tuple[Unit] | None:
        with lock:
            return None if stop.stopped or not pending else (pending.popleft(),)

    def serve(slot: DeviceSlot) -> None:
        while (taken := take()) is not None:
            unit, = taken
            try:
                work(unit, slot, stop)
            except Cancelled:
                return
            except BaseException as exc:  # noqa: BLE001 (re-raised in the main thread)
                errors.append(exc)
                stop.stop()
                return

    # Workers die with the thread that started them (PR_SET_PDEATHSIG): each slot's
    # thread lives until its last worker is done.
    threads = [threading.Thread(target=serve, args=(slot,), name=f"devices-{slot.index}",
                                daemon=True) for slot in slots]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # short waits: a signal's handler runs in between
    except BaseException:
        stop.stop()
        for thread in threads:
            thread.join()
        raise
    if errors:
        raise errors[0]


__all__ = ["DeviceSlot", "Stop", "device_slots", "spread"]
