"""The smallest ddptrain script: model, loss, data, Trainer(...).fit().

    python examples/minimal.py [key=value ...]
    torchrun --nproc_per_node=2 examples/minimal.py trainer.max_epochs=40

Under torchrun each rank takes its half of the data (DistributedSampler), so an epoch is half as
many optimizer steps of a batch twice as large (2 x 32): the same 20 epochs are 160 steps, not 320,
and end at a higher loss (4.76 against 0.0076 alone). trainer.max_epochs=40 gives 2 ranks the same
320 steps and loss (0.0059).
"""
import sys, torch, ddptrain
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

cfg = ddptrain.load_config(None, ["trainer.output_dir=runs/minimal", "trainer.max_epochs=20", "optim.lr=0.05",
                                  "logging.log_every=20", *sys.argv[1:]])
info = ddptrain.setup_distributed(cfg)  # no-op under plain python; joins the group under torchrun
x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
data = TensorDataset(x, x @ torch.arange(1.0, 9.0) + 0.5)
loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, info.world_size, info.rank))
model = torch.nn.Linear(8, 1)

def loss_fn(model, batch):  # the loss contract: (sum over units, number of units)
    x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).sum(), len(y)

result = ddptrain.Trainer(model, loss_fn, cfg, loader, eval_data=loader).fit()  # every rank gets it
if info.is_main: print(result)
