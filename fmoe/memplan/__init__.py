"""The memory-plan program (``python -m fmoe.plan``): flags in, the per-rank plan of
:mod:`fmoe.memory.plan` out. It lives above the library, apart from the sharding
:class:`fmoe.Plan` whose package name the command keeps."""
