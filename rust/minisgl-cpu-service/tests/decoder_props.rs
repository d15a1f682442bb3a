//! The message decoder never panics: arbitrary bytes, and valid frames truncated or with bytes
//! flipped, decode to a message or to a `WireError` (property tests).

use minisgl_cpu_service::wire::{self, Inbound};
use proptest::prelude::*;
use rmpv::Value;

fn frame(items: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Array(items)).expect("write to a Vec");
    out
}

fn params() -> Value {
    Value::Array(vec![
        0.0.into(),
        (-1).into(),
        1.0.into(),
        16.into(),
        false.into(),
        Value::Nil,
        Value::Array(vec!["END".into()]),
        Value::Nil,
        true.into(),
        0.0.into(),
        0.0.into(),
        1.0.into(),
        0.0.into(),
        Value::Nil,
        0.into(),
        Value::Nil,
        0.into(),
        Value::Nil,
        0.into(), // priority (schema 6)
    ])
}

fn valid_frames() -> Vec<Vec<u8>> {
    vec![
        frame(vec![
            wire::SCHEMA_VERSION.into(),
            1.into(),
            7.into(),
            "text".into(),
            "héllo".into(),
            params(),
        ]),
        frame(vec![
            wire::SCHEMA_VERSION.into(),
            1.into(),
            8.into(),
            "ids".into(),
            Value::Array(vec![1.into()]),
            params(),
        ]),
        frame(vec![wire::SCHEMA_VERSION.into(), 2.into(), 9.into()]),
        frame(vec![
            wire::SCHEMA_VERSION.into(),
            14.into(),
            4.into(),
            wire::i32_bytes(&[1, 2, 3]),
            Value::Array(vec![]),
            Value::Array(vec![]),
            Value::Nil,
        ]),
        frame(vec![
            wire::SCHEMA_VERSION.into(),
            12.into(),
            0.into(),
            42.into(),
            wire::map(vec![
                ("num_pages", 64.into()),
                ("max_seq_len", 256.into()),
                ("vocab_size", 384.into()),
                ("page_size", 1.into()),
                ("eos_token_ids", Value::Array(vec![2.into()])),
            ]),
            Value::Nil,
        ]),
    ]
}

#[test]
fn the_valid_frames_decode() {
    for f in valid_frames() {
        assert!(wire::decode(&f).is_ok(), "{f:?}");
    }
    match wire::decode(&valid_frames()[3]) {
        Ok(Inbound::StepResult { tokens, .. }) => assert_eq!(tokens, vec![1, 2, 3]),
        other => panic!("{other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = wire::decode(&bytes);
    }

    #[test]
    fn truncated_frames_are_errors(which in 0usize..5, cut in 0usize..64) {
        let f = &valid_frames()[which];
        let cut = cut.min(f.len().saturating_sub(1));
        prop_assert!(wire::decode(&f[..cut]).is_err());
    }

    #[test]
    fn flipped_bytes_never_panic(which in 0usize..5, pos in 0usize..64, byte in any::<u8>()) {
        let mut f = valid_frames()[which].clone();
        let n = f.len();
        f[pos % n] = byte;
        let _ = wire::decode(&f);
    }
}
