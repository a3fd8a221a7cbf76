"""Distributed input: options, splitting global batches, datasets and read-ahead."""

from keras_dist._input._dataset import DistributedDataset as DistributedDataset
from keras_dist._input._dataset import DistributedIterator as DistributedIterator
from keras_dist._input._dataset import EndOfInput as EndOfInput
from keras_dist._input._dataset import JoinedReplicas as JoinedReplicas
from keras_dist._input._dataset import Optional as Optional
from keras_dist._input._numpy_dataset import NumpyDataset as NumpyDataset
from keras_dist._input._options import InputContext as InputContext
from keras_dist._input._options import InputOptions as InputOptions
from keras_dist._input._options import InputReplicationMode as InputReplicationMode
from keras_dist._input._options import checked_input_options as checked_input_options
from keras_dist._input._prefetch import Prefetch as Prefetch
from keras_dist._input._sparse import densify as densify
from keras_dist._input._split import GlobalBatchSplitter as GlobalBatchSplitter
from keras_dist._input._split import batch_rows as batch_rows
from keras_dist._input._split import splits_evenly as splits_evenly
from keras_dist._input._split import stacked_rows as stacked_rows
