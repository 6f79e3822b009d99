"""Worker of tests/test_recipes.py::test_fsdp2_on_two_cpu_processes_trains_an_mlr_model_like_one_process.

Trains the tiny MLR GPT-2 for a few AdamW steps on a fixed global batch, in float64. Under ``torch.distributed.run``
with 2 processes (gloo) every StructAttnGPT2Block and then the whole model are wrapped with torch's FSDP2
``fully_shard`` (the wrapping configs/accelerate_fsdp.yaml asks accelerate for) and each rank trains on its half of
the batch; alone it trains the plain model on the whole batch. Rank 0 saves the full state dict and the losses.

    python tests/fsdp_train_worker.py OUT.pt
"""

import os
import sys

import torch


def main(out_path: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    config = StructAttnGPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=2, n_head=2, attention="mlr",
                                  mlr_ranks=[8, 4, 2, 2], resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=256,
                                  eos_token_id=256, pad_token_id=256)
    model = StructAttnGPT2LMHeadModel(config).train()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    mine = ids[rank::world]  # equal shards: FSDP's gradient average equals the full-batch mean
    losses = []
    for _ in range(3):
        logits = model(input_ids=mine, use_cache=False).logits  # float64 (transformers' loss would upcast to fp32)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
    state = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
             for name, value in model.state_dict().items()}
    if rank == 0:
        torch.save({"state": state, "losses": losses}, out_path)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
