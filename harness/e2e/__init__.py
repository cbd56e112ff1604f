"""The real-engine tier: SGLang's own ``sglang.Engine`` on the CPU (``make e2e``).

- ``checkpoints``: tiny target/draft pairs written at test time (``save_pretrained`` /
  safetensors) with a local tokenizer (``tokenizer``), among them the *constructed* pair
  whose draft predicts the target exactly only when the target's last layer is captured;
- ``engine``: one Engine per configuration in a driver process of its own
  (``driver``), every case sent through it, with timeouts and a process-group kill;
- ``probe``: what the target captured and what the draft's ``fc`` received, recorded in
  the scheduler process.

The CPU stand-ins the Engine needs are ``harness.standins.cpu_engine``.
"""
