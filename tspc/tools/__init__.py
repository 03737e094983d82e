"""Tools around the backend: the planner (``plan``), the fake-tensor memory measurement
(``measure``) and the CPU allocator trackers (``memory``), ``tspc dump`` (``dump_cli``) with
its CUDA checks (``device_check``, ``fake_cuda``), and the ``tspc`` command (``cli``).

The backend core (``tspc.backend``, ``tspc.pipeline``, ``tspc.inner``, the passes, the runtime
and the ops) never imports anything from here.
"""
