"""Encoder family: BERT (MiniLM is a BERT) and DistilBERT. One engine, role `decode` (the role
of every single-engine model); static shapes, so no optimization profile. Network:
`network.py`."""
from pipeline.families import EncoderIO, EncoderWorkload, Family

IO = EncoderIO()
FAMILY = Family(
    name="bert", model_types=("bert", "distilbert"), kind="encoder", io=IO,
    default_options={"precision": "fp16", "sequence_length": 256},
    precisions={"fp16": "FP16", "fp32": "FP32"},
    network_module="pipeline.families.bert.network", workload=EncoderWorkload,
)
