from __future__ import annotations

import torch

# Tests are deterministic and small; two threads match the CI machine.
torch.set_num_threads(2)
