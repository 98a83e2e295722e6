"""Execution: how a scheduled step runs on the device. It owns the model runner (eager, CUDA graphs), the
step's tensors built from the scheduler's contract (StepInputs, page tables), the sampler, and the
tensor-parallel worker loop that replays each step on ranks 1..tp-1. It receives a SchedulerOutput and returns
token ids; it must not decide what runs (the scheduler does) or what stays cached (engine/cache does).
"""
