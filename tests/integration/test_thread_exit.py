"""The shim's pthread_exit (native/src/python/thread_exit.cc) is glibc's outside a finalizing
Python interpreter: a C program's threads that call it still end, with their exit value."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("fakegpu_abi_ncclh", Path(__file__).parent / "abi" / "ncclh.py")
ncclh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncclh)

PROGRAM = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>

static void* body(void* arg) {
  pthread_exit((void*)((intptr_t)arg + 1));
  return NULL;
}

int main(void) {
  for (intptr_t i = 0; i < 4; ++i) {
    pthread_t t;
    void* value = NULL;
    if (pthread_create(&t, NULL, body, (void*)i) != 0 || pthread_join(t, &value) != 0) return 2;
    if ((intptr_t)value != i + 1) return 3;
  }
  puts("joined");
  return 0;
}
"""


def test_a_c_programs_threads_exit_with_their_value_under_the_preloaded_shim(shim_library, tmp_path):
    cc = ncclh.compiler("c")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    source = tmp_path / "threads.c"
    source.write_text(PROGRAM)
    binary = tmp_path / "threads"
    subprocess.run([cc, str(source), "-o", str(binary), "-pthread"], check=True, timeout=120)
    done = subprocess.run([str(binary)], env={"LD_PRELOAD": shim_library}, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "joined"), done.stderr
    # The interposer is the shim's: the program's pthread_exit resolved to it.
    symbols = subprocess.run(["nm", "-D", "--defined-only", shim_library], capture_output=True,
                             text=True, check=True).stdout
    assert " T pthread_exit" in symbols
