"""A Horovod elastic PyTorch script, written as Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py is.

The only hvddp-specific line is the import (``import horovod.torch as hvd`` before). Under
``mpiexec`` the ranks are fixed: ``hvd.elastic.run`` syncs the state from rank 0 and trains; the
commits and host checks run and find no change. The data are scikit-learn's digits instead of
MNIST so that nothing is downloaded, and the model is a small MLP. tests/test_torch.py runs it
under ``mpiexec -n 2`` and checks the accuracy rank 0 prints.
"""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvddp.torch as hvd

parser = argparse.ArgumentParser(description='PyTorch digits elastic Example')
parser.add_argument('--batch-size', type=int, default=16, help='input batch size for training')
parser.add_argument('--epochs', type=int, default=6, help='number of epochs to train')
parser.add_argument('--lr', type=float, default=0.05, help='learning rate')
parser.add_argument('--momentum', type=float, default=0.9, help='SGD momentum')
parser.add_argument('--seed', type=int, default=42, help='random seed')
parser.add_argument('--batches-per-commit', type=int, default=10,
                    help='number of batches processed before calling `state.commit()`')
parser.add_argument('--batches-per-host-check', type=int, default=5,
                    help='number of batches processed before checking for host updates')
args = parser.parse_args()

# Horovod: initialize library.
hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)

x, y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split((x / 16.0).astype(np.float32), y, test_size=0.25,
                                                    random_state=0)
train_dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
test_dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test))

# Horovod: use ElasticSampler to partition data among workers.
train_sampler = hvd.elastic.ElasticSampler(train_dataset)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                               rank=hvd.rank())
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=256, sampler=test_sampler)

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10), nn.LogSoftmax(dim=1))

# Horovod: scale learning rate by the number of workers.
optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def evaluate(epoch):
    model.eval()
    correct = 0.
    with torch.no_grad():
        for data, target in test_loader:
            correct += model(data).argmax(dim=1).eq(target).float().sum().item()
    # Horovod: average metric values across workers.
    accuracy = metric_average(correct / len(test_sampler), 'avg_accuracy')
    if hvd.rank() == 0:
        print('Epoch {}: test accuracy: {:.2f}%'.format(epoch, 100. * accuracy))


@hvd.elastic.run
def train(state):
    # Horovod: the loop resumes from the committed epoch and batch after a reset.
    for state.epoch in range(state.epoch, args.epochs + 1):
        state.model.train()
        state.train_sampler.set_epoch(state.epoch)
        for state.batch, (data, target) in enumerate(train_loader):
            state.optimizer.zero_grad()
            loss = F.nll_loss(state.model(data), target)
            loss.backward()
            state.optimizer.step()
            # Horovod: record which samples this worker has processed.
            state.train_sampler.record_batch(state.batch, args.batch_size)
            if state.batch % args.batches_per_commit == 0:
                # Horovod: commit state at the end of each batch
                state.commit()
            elif state.batch % args.batches_per_host_check == 0:
                # Horovod: check for new hosts without committing
                state.check_host_updates()
        evaluate(state.epoch)
        state.batch = 0
        state.commit()


def on_state_reset():
    # Horovod: scale the learning rate by the new number of workers.
    for param_group in optimizer.param_groups:
        param_group['lr'] = args.lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
