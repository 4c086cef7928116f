"""A fake-CUDA program that leaves a daemon thread computing on the GPU when it exits.

CPython 3.11-3.13 end such a thread with pthread_exit when it next asks for the GIL during
finalization; with fakegpu's torch modes in the thread, that unwound torch's C++ frames and
aborted the finished process.  A second thread that ended normally first leaves its modes."""
import threading
import time

import torch

assert torch.cuda.is_available()


def spin():
    x = torch.ones(4, device="cuda")
    while True:
        x = x + 1


def ends():
    assert torch.ones(2, device="cuda").sum().item() == 2


threading.Thread(target=spin, daemon=True).start()
done = threading.Thread(target=ends)
done.start()
done.join()
time.sleep(0.2)
print("main done", flush=True)
