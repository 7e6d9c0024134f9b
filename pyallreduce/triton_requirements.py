"""Which Triton (and, under its interpreter, which numpy) the kernels run
with: one place, read by signal.py when the kernels are imported and by the
tests, which skip saying why."""
MIN_TRITON = (3, 6)  # the oldest tested (scripts/torch_matrix.sh); signal.py reads triton.knobs


def _version(text):
    """(major, minor) of a version string such as "3.6.0" or "2.4.0rc1"."""
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in text.split(".")[:2])


def triton_too_old():
    """Why the installed Triton cannot run the kernels at all, or None."""
    import triton

    if _version(triton.__version__) < MIN_TRITON:
        return (f"pyallreduce's Triton kernels need Triton >= {'.'.join(map(str, MIN_TRITON))}, this is "
                f"{triton.__version__} (torch 2.4's wheels pin Triton 3.0, for one); backend='cuda' and 'cpu' do not "
                "need Triton")
    return None


def interpreter_unusable():
    """Why TRITON_INTERPRET=1 cannot run the kernels here, or None."""
    import numpy as np
    import triton

    # Seen with Triton 3.6: its interpreter turns a one-element array into an
    # index with int(), which numpy 2.4 refuses ("only 0-dimensional arrays").
    if _version(triton.__version__) < (3, 8) and _version(np.__version__) >= (2, 4):
        return (f"the Triton interpreter (TRITON_INTERPRET=1) of Triton {triton.__version__} cannot run these "
                f"kernels with numpy {np.__version__}: use Triton >= 3.8 or numpy < 2.4")
    return None
