"""The run folder and the processes sharing it. Takes plain values (paths, counts, the accelerator) and never
imports `mmcl.training`::

    folder.py     the one rule for a run folder, its record and summary, config.yaml, out.log
    lock.py       the folder's lock, held for the whole run
    resume.py     the newest intact checkpoint, loaded into what a run restores
    records.py    metrics.jsonl and the trackers
    console.py    the one way to say a line (`say`), through the progress bar when one is shown
    processes.py  the processes of a run: the one is-main, agreement, any-process, others-wait
    signals.py    stop signals (SIGTERM, SIGUSR1, SIGINT) and their exit codes
"""
