"""Training: tf.data input from the Beam job's TFRecords and the Keras/TFRS fit loop."""
